"""What assess writes for people: report.md (reads in a minute) and the throughput / TTFT plots."""
from __future__ import annotations

from pathlib import Path

from drafter_data.plots import png_figure


def plot(levels: list[dict], out_dir: Path) -> list[Path]:
    x = [lv["concurrency"] for lv in levels]
    paths = []
    for name, keys, ylabel in (("throughput.png", [("output_tokens_per_s", "output tok/s")], "output tokens/s"),
                               ("ttft.png", [("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")], "time to first token (s)")):
        with png_figure(out_dir / name) as ax:
            for key, label in keys:
                ax.plot(x, [lv[key] or 0 for lv in levels], marker="o", label=label)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend()
        paths.append(out_dir / name)
    return paths


def report(metrics: dict, model: str, thinking: bool) -> str:
    p = metrics["projection"]
    warning = metrics.get("caveat")
    lines = [f"# Server assessment: {model} ({'thinking on' if thinking else 'thinking off'})", "",
             *([f"> **Not a projection of the real job.** {warning}.", ""] if warning else []),
             f"Best level: **{metrics['best']['concurrency']} concurrent requests, "
             f"{metrics['best']['output_tokens_per_s']:.1f} output tok/s**.", "",
             f"The job, {p['completions']:,} completions x {p['tokens_per_completion']:,.0f} tokens, takes "
             f"**{p['hours']:,.1f} hours ({p['days']:,.1f} days)** at that rate and needs about "
             f"**{p['storage_gb']:,.1f} GB** (completions {p.get('completions_storage_gb', 0):,.2f} GB as Parquet, "
             f"tokens {p['tokens_storage_gb']:,.2f} GB as int32 ids + int8 masks, uncompressed).", "",
             "| concurrency | output tok/s | requests/s | TTFT p50 (s) | TTFT p99 (s) | ITL (ms) | tokens/completion |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for lv in metrics["levels"]:
        lines.append(f"| {lv['concurrency']} | {lv['output_tokens_per_s']:.1f} | {lv['requests_per_s']:.2f} | "
                     f"{fmt(lv['ttft_p50_s'], '.2f')} | {fmt(lv['ttft_p99_s'], '.2f')} | "
                     f"{fmt(lv['itl_mean_s'] and lv['itl_mean_s'] * 1000, '.1f')} | {lv['completion_tokens_mean']:.0f} |")
    lines += ["", "## What if", "", "| case | completions | tokens/completion | days | storage (GB) |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for row in metrics["what_if"]:
        lines.append(f"| {row['case']} | {row['completions']:,} | {row['tokens_per_completion']:,.0f} | "
                     f"{row['days']:,.1f} | {row['storage_gb']:,.1f} |")
    lines += ["", "![throughput](throughput.png) ![ttft](ttft.png)", ""]
    return "\n".join(lines)
