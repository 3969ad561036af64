"""The card's pictures (PNG, also logged to MLflow), drawn from the export's fixed-size counters."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from drafter_data.export.build import LOG2_BINS, Result
from drafter_data.plots import png_figure

FILES = ("rows_per_source.png", "quality_per_source.png", "turns.png", "token_lengths.png", "finish_reasons.png",
         "loss_tokens.png")


def bin_labels() -> list[str]:
    labels = ["0", "1"]
    for b in range(2, LOG2_BINS):
        labels.append(f"{2 ** (b - 1)}-{2 ** b - 1}")
    return labels


def _used(*arrays: np.ndarray) -> slice:
    nonzero = [np.flatnonzero(a) for a in arrays if a.any()]
    if not nonzero:
        return slice(0, 1)
    return slice(min(int(n[0]) for n in nonzero), max(int(n[-1]) for n in nonzero) + 1)


def draw(result: Result, out_dir: Path, drift: dict, per_conversation: bool = False) -> list[Path]:
    fig = result.figures
    sources = sorted(fig.by_source)
    paths = [out_dir / name for name in FILES]
    height = max(3.0, 0.45 * len(sources) + 2.0)

    with png_figure(paths[0], size=(7, height)) as ax:
        on = [fig.by_source[s]["thinking_on"] for s in sources]
        off = [fig.by_source[s]["thinking_off"] for s in sources]
        ax.barh(sources, on, label="thinking on")
        ax.barh(sources, off, left=on, label="thinking off")
        ax.set_xlabel("training rows")
        ax.set_title(f"{result.rows_in} rows per source and thinking mode")
        ax.legend()

    with png_figure(paths[1], size=(7, height)) as ax:
        y = np.arange(len(sources))
        shares = {"cut by max_tokens": "length_cut", "degenerate": "degenerate", "not exact on re-render": None}
        for k, (label, key) in enumerate(shares.items()):
            values = []
            for s in sources:
                c = fig.by_source[s]
                n = c["rows"] or 1
                values.append((c["rows"] - c["exact"]) / n if key is None else c[key] / n)
            ax.barh(y + (k - 1) * 0.27, values, height=0.27, label=label)
        ax.set_yticks(y, sources)
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the source's rows")
        ax.set_title("is the prompt mix right for this target? (per source)")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)

    with png_figure(paths[2]) as ax:
        turns = sorted(fig.turn_rows)
        # per_turn: a row per turn, so conversations with exactly k+1 turns = rows of turn k - rows of turn k+1;
        # conversation rows: one row per conversation, at its last turn
        exactly = [fig.turn_rows[k] - (0 if per_conversation else fig.turn_rows.get(k + 1, 0)) for k in turns]
        ax.bar([str(k + 1) for k in turns], exactly)
        ax.set_xlabel("turns in the conversation")
        ax.set_ylabel("conversations")
        ax.set_title(f"{sum(exactly)} conversations by number of turns")

    with png_figure(paths[3], size=(7, 3.5)) as ax:
        used = _used(fig.reasoning, fig.answer)
        labels = bin_labels()[used]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, fig.reasoning[used], width=0.4,
               label="reasoning" + (" (estimated)" if fig.reasoning_estimated else ""))
        ax.bar(x + 0.2, fig.answer[used], width=0.4, label="answer")
        ax.set_xticks(x, labels, rotation=45, fontsize=7)
        ax.set_xlabel("tokens per answer")
        ax.set_ylabel("rows")
        ax.set_title("reasoning and answer lengths")
        ax.legend()

    with png_figure(paths[4]) as ax:
        names = sorted(fig.finish)
        ax.bar(names, [fig.finish[n] for n in names])
        ax.set_ylabel("rows")
        ax.set_title("finish reasons (length: cut by max_tokens, and where)")
        ax.tick_params(axis="x", labelsize=8)

    with png_figure(paths[5]) as ax:
        used = _used(fig.loss)
        labels = bin_labels()[used]
        ax.bar(labels, fig.loss[used])
        ax.tick_params(axis="x", labelsize=7, rotation=45)
        ax.set_xlabel("loss tokens per row")
        ax.set_ylabel("rows")
        rate = drift.get("rate", 0.0)
        ax.set_title(f"loss tokens per row (drift: {drift.get('rows_differ', 0)} of {drift.get('rows_compared', 0)} "
                     f"rows, rate {rate:.3f})", fontsize=9)
    return paths
