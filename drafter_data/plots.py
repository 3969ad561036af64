"""PNG figures for reports and MLflow, drawn off-screen (matplotlib's Agg backend, imported only when drawing)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


@contextmanager
def png_figure(path: Path, size: tuple[float, float] = (6, 3.5)):
    """with png_figure(path) as ax: ax.plot(...)  -- saved to path (dpi 100) and closed on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
