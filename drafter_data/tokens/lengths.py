"""Length histograms of tokens per training row, and per regenerated turn the tokens of its reasoning and of its answer.

The bins are a fixed half-octave grid (1, 1.4, 2, 2.8, 4, ... up to max_length) plus a count of zero lengths, so the
memory they take is flat however many rows pass and workers' histograms add up; the plot shows only the bins from
the shortest length seen to the longest, on a log axis, so the data fills it whatever max_length is.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

SERIES = ("row", "reasoning", "answer")
LABELS = {"row": "whole row", "reasoning": "reasoning (per turn)", "answer": "answer (per turn)"}


class LengthHistograms:
    def __init__(self, max_length: int):
        steps = int(np.ceil(2 * np.log2(max(int(max_length), 2))))
        self.edges = 2.0 ** (np.arange(steps + 1) / 2)  # 1 .. >= max_length, half an octave apart
        self.counts = {name: np.zeros(steps, dtype=np.int64) for name in SERIES}
        self.zeros = {name: 0 for name in SERIES}  # lengths of 0 (no reasoning): no place on a log axis

    def add(self, name: str, values: list[int]) -> None:
        if values:
            v = np.asarray(values, dtype=np.float64)
            self.zeros[name] += int((v < 1).sum())
            self.counts[name] += np.histogram(np.minimum(v[v >= 1], self.edges[-1]), bins=self.edges)[0]

    def merge(self, other: LengthHistograms) -> None:
        for name in SERIES:
            self.counts[name] += other.counts[name]
            self.zeros[name] += other.zeros[name]

    def span(self) -> tuple[int, int]:
        """The bins [lo, hi) from the first holding a length to the last (the first bin when none does)."""
        held = np.flatnonzero(sum(self.counts.values()))
        return (int(held[0]), int(held[-1]) + 1) if held.size else (0, 1)

    def draw(self, ax, estimated_reasoning: bool) -> None:
        from matplotlib.ticker import FuncFormatter

        lo, hi = self.span()
        edges = self.edges[lo:hi + 1]
        for name, style in (("reasoning", "-"), ("answer", "-"), ("row", ":")):
            label = LABELS[name] + (", estimated" if name == "reasoning" and estimated_reasoning else "")
            if self.zeros[name]:
                label += f"; {self.zeros[name]} of 0 tokens, not shown"
            ax.stairs(self.counts[name][lo:hi], edges, label=label, linestyle=style)
        ax.set_xscale("log", base=2)
        ax.set_xlim(edges[0], edges[-1])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_xlabel("tokens (half-octave bins)")
        ax.set_ylabel("count")
        ax.set_title(f"{int(self.counts['row'].sum())} rows: loss tokens of reasoning vs answer")
        ax.legend(fontsize="small")

    def plot(self, path: Path, estimated_reasoning: bool) -> None:
        from drafter_data.plots import png_figure

        with png_figure(path, size=(7, 4)) as ax:
            self.draw(ax, estimated_reasoning)
