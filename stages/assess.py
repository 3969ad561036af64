"""assess: measure the server's real throughput at several concurrency levels and project the whole job's time and
storage before anyone commits weeks of GPU time (metrics.json, report.md, plots).

Each level runs unique prompts (repeats would hit the prefix cache and inflate throughput) through the same client
path and thinking switch as generate; rates are taken over a steady window, ramp-up and tail excluded.
"""
from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from drafter_data import server_client as sc
from drafter_data.config import StageError, run_stage
from drafter_data.local_server import local_server
from drafter_data.parquet_io import iter_batches, shard_paths
from drafter_data.projection import project, what_if
from drafter_data.tracking import stage_run

_WALL_OFFSET = time.time() - time.monotonic()
TOPICS = ["the history of the printing press", "how vaccines train the immune system", "binary search trees",
          "the water cycle", "compound interest", "the French Revolution", "photosynthesis", "TCP congestion control",
          "plate tectonics", "the rules of chess", "sourdough baking", "black holes", "supply and demand",
          "the Pythagorean theorem", "garbage collection in Java", "jazz improvisation", "coral reefs",
          "public-key cryptography", "the Silk Road", "how airplanes fly"]
TASKS = ["Explain {} to a curious teenager.", "Write a short quiz with answers about {}.",
         "List common misconceptions about {} and correct them.", "Summarize {} in five bullet points.",
         "Write a dialogue between two students discussing {}."]


def builtin_prompts():
    i = 0
    while True:
        for task in TASKS:
            for topic in TOPICS:
                yield [{"role": "user", "content": f"({i}) {task.format(topic)}"}]
                i += 1


def prompt_source(cfg):
    """Real prompts from prepare's output when there are some, then built-in varied ones; never a repeat."""
    paths = shard_paths(Path(cfg.generate.input)) if Path(cfg.generate.input).exists() else []
    for batch in iter_batches(paths, columns=["messages"]):
        for row in batch.to_pylist():
            yield row["messages"]
    yield from builtin_prompts()


@dataclass
class Sample:
    start: float
    end: float
    ttft: float | None
    tokens: int
    chunks: list = field(default_factory=list)
    reasoning: str | None = None
    content: str = ""


async def measure_level(client, params: dict, thinking: bool, prompts, concurrency: int, n_requests: int):
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(n_requests):
        queue.put_nowait(next(prompts))
    samples: list[Sample] = []
    started, drained, retries = [], [], []

    async def worker():
        first = True
        while True:
            try:
                messages = queue.get_nowait()
            except asyncio.QueueEmpty:
                drained.append(time.monotonic())
                return
            if first:
                started.append(time.monotonic())
                first = False
            for attempt in range(1, 6):  # same fault handling as generate; retries are counted in the level's stats
                t0 = time.monotonic()
                try:
                    done = await sc.complete(client, messages, params, thinking, stream=True, record_times=True)
                    break
                except Exception as exc:  # noqa: BLE001
                    fault = sc.classify(exc)
                    if fault.kind == "permanent" or attempt == 5:
                        raise StageError(f"assess: a request failed: {fault.reason}") from None
                    retries.append(fault.reason)
                    await asyncio.sleep(sc.backoff_s(attempt, retry_after=fault.retry_after_s))
            samples.append(Sample(t0, time.monotonic(), done.ttft_s, done.completion_tokens or len(done.token_times),
                                  done.token_times, done.reasoning, done.content))

    t_begin = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    t_end = time.monotonic()
    # steady window: from when every worker had a request in flight to when the first found the queue empty
    w0, w1 = max(started), min(drained)
    if w1 - w0 < 0.5:  # too few requests for a steady state: use the whole run
        w0, w1 = t_begin, t_end
    return samples, (w0, w1), len(retries)


def summarize(concurrency: int, samples: list[Sample], window: tuple[float, float]) -> dict:
    w0, w1 = window
    span = w1 - w0
    in_window = 0.0
    for s in samples:  # each chunk carries usage tokens / chunks, so totals match the server's usage
        if s.chunks:
            per_chunk = s.tokens / len(s.chunks)
            in_window += per_chunk * sum(1 for t in s.chunks if w0 <= t < w1)
    finished = sum(1 for s in samples if w0 <= s.end < w1)
    ttft = np.array([s.ttft for s in samples if s.ttft is not None])
    itl = [(s.end - s.start - s.ttft) / (s.tokens - 1) for s in samples if s.ttft is not None and s.tokens > 1]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "window_s": span,
        "window_unix": [w0 + _WALL_OFFSET, w1 + _WALL_OFFSET],
        "output_tokens_per_s": in_window / span if span > 0 else 0.0,
        "requests_per_s": finished / span if span > 0 else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
        "itl_mean_s": float(np.mean(itl)) if itl else None,
        "completion_tokens_mean": float(np.mean([s.tokens for s in samples])),
    }


def completion_bytes_per_token(samples: list[Sample]) -> float | None:
    """Parquet (zstd) bytes per output token, measured on the answers actually received."""
    tokens = sum(s.tokens for s in samples)
    if not tokens:
        return None
    table = pa.table({"reasoning": [s.reasoning for s in samples], "content": [s.content for s in samples]})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.tell() / tokens


def answer_share(samples: list[Sample]) -> float | None:
    """The answer's share of the output characters: what would remain with thinking off (an estimate)."""
    total = sum(len(s.reasoning or "") + len(s.content) for s in samples)
    share = sum(len(s.content) for s in samples) / total if total else None
    return share or None


def plot(levels: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [lv["concurrency"] for lv in levels]
    paths = []
    for name, keys, ylabel in (("throughput.png", [("output_tokens_per_s", "output tok/s")], "output tokens/s"),
                               ("ttft.png", [("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")], "time to first token (s)")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in keys:
            ax.plot(x, [lv[key] or 0 for lv in levels], marker="o", label=label)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def report(metrics: dict, cfg) -> str:
    p = metrics["projection"]
    lines = [f"# Server assessment: {cfg.server.model} ({'thinking on' if cfg.generation.thinking else 'thinking off'})",
             "", f"Best level: **{metrics['best']['concurrency']} concurrent requests, "
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


async def _assess(cfg, url: str) -> dict:
    a = cfg.assess
    levels = sorted({int(c) for c in a.concurrency})
    if not levels:
        raise StageError("assess.concurrency is empty: give the concurrency levels to measure, e.g. [1, 4, 16]")
    params = sc.request_params(cfg.target, cfg.generation, cfg.server.model)
    params["max_tokens"] = int(a.get("max_tokens") or cfg.generation.max_tokens)
    thinking = bool(cfg.generation.thinking)
    client = sc.make_client(url, sc.api_key(cfg.server), max(levels), float(cfg.generate.request_timeout_s))
    try:
        await sc.preflight(client, url, cfg.server.model, params, thinking, True)
        prompts = prompt_source(cfg)
        results, all_samples = [], []
        for c in levels:
            n = max(int(a.requests_per_level), 3 * c)
            samples, window, retries = await measure_level(client, params, thinking, prompts, c, n)
            results.append({**summarize(c, samples, window), "retries": retries})
            all_samples += samples
            lv = results[-1]
            print(f"concurrency {c:>4}: {lv['output_tokens_per_s']:8.1f} tok/s  {lv['requests_per_s']:6.2f} req/s  "
                  f"TTFT p50 {lv['ttft_p50_s'] or 0:.2f} s", file=sys.stderr)
    finally:
        await client.close()
    best = max(results, key=lambda lv: lv["output_tokens_per_s"])
    kw = {"completion_bytes_per_token": completion_bytes_per_token(all_samples)}
    share = answer_share(all_samples)
    projection = project(best["output_tokens_per_s"], int(a.num_completions), float(a.completion_tokens), **kw)
    return {"levels": results, "best": best, "projection": projection,
            "what_if": what_if(best["output_tokens_per_s"], int(a.num_completions), float(a.completion_tokens),
                               share, **kw),
            "measured": {"completion_tokens_mean": float(np.mean([s.tokens for s in all_samples])),
                         "completion_bytes_per_token": kw["completion_bytes_per_token"],
                         "answer_share": share, "thinking": thinking}}


def main(cfg) -> int:
    out_dir = Path(cfg.assess.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    with local_server(cfg.server) as urls:
        url = sc.base_urls(cfg.server, urls)[0]
        metrics = asyncio.run(_assess(cfg, url))
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (out_dir / "report.md").write_text(report(metrics, cfg))
    pngs = plot(metrics["levels"], out_dir)
    p = metrics["projection"]
    print(f"projection: {p['completions']:,} x {p['tokens_per_completion']:,.0f} tokens at "
          f"{p['output_tokens_per_s']:.1f} tok/s = {p['hours']:,.1f} h ({p['days']:,.1f} days), "
          f"{p['storage_gb']:,.1f} GB; report in {out_dir / 'report.md'}", file=sys.stderr)
    with stage_run("assess", cfg) as run:
        run.metrics({"best.output_tokens_per_s": metrics["best"]["output_tokens_per_s"],
                     "best.concurrency": metrics["best"]["concurrency"],
                     "projection.hours": p["hours"], "projection.days": p["days"],
                     "projection.storage_gb": p["storage_gb"]})
        for lv in metrics["levels"]:
            run.metrics({f"level.{k}": lv[k] for k in ("output_tokens_per_s", "requests_per_s", "ttft_p50_s",
                                                        "ttft_p99_s")}, step=lv["concurrency"])
        for path in [out_dir / "metrics.json", out_dir / "report.md", *pngs]:
            run.artifact(path)
    return 0


if __name__ == "__main__":
    run_stage(main)
