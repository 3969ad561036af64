"""Length histograms with fixed bins over [0, max_length], so the memory they take is flat however many rows pass:
tokens per training row, and per regenerated turn the tokens of its reasoning and of its answer."""
from __future__ import annotations

from pathlib import Path

import numpy as np

BINS = 64
SERIES = ("row", "reasoning", "answer")


class LengthHistograms:
    def __init__(self, max_length: int):
        self.edges = np.linspace(0, max(int(max_length), BINS), BINS + 1)
        self.counts = {name: np.zeros(BINS, dtype=np.int64) for name in SERIES}

    def add(self, name: str, values: list[int]) -> None:
        if values:
            clipped = np.minimum(np.asarray(values, dtype=np.float64), self.edges[-1])
            self.counts[name] += np.histogram(clipped, bins=self.edges)[0]

    def merge(self, other: LengthHistograms) -> None:
        for name in SERIES:
            self.counts[name] += other.counts[name]

    def plot(self, path: Path, estimated_reasoning: bool) -> None:
        from drafter_data.plots import png_figure

        with png_figure(path, size=(7, 4)) as ax:
            ax.stairs(self.counts["reasoning"], self.edges, label="reasoning (per turn)"
                      + (", estimated" if estimated_reasoning else ""))
            ax.stairs(self.counts["answer"], self.edges, label="answer (per turn)")
            ax.stairs(self.counts["row"], self.edges, label="whole row", linestyle=":")
            ax.set_xlabel("tokens")
            ax.set_ylabel("count")
            ax.set_title(f"{int(self.counts['row'].sum())} rows: loss tokens of reasoning vs answer")
            ax.legend()
