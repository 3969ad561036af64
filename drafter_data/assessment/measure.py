"""One concurrency level measured: unique prompts through generate's own client path, the output tokens counted
over a steady window (from when every worker has a request in flight to when the first finds the queue empty), so
ramp-up and tail do not dilute the rate."""
from __future__ import annotations

import asyncio
import io
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from drafter_data.contract import iter_batches, shard_paths
from drafter_data.errors import StageError
from drafter_data.server.client import complete
from drafter_data.server.faults import call_with_retries, classify
from drafter_data.server.request import RequestSpec

_WALL_OFFSET = time.time() - time.monotonic()
RETRY_ATTEMPTS = 5
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


def prompt_source(prompts_dir: str | None):
    """Real prompts from prepare's output when there are some, then built-in varied ones; never a repeat."""
    paths = shard_paths(Path(prompts_dir)) if prompts_dir and Path(prompts_dir).exists() else []
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


async def measure_level(client, spec: RequestSpec, prompts, concurrency: int, n_requests: int):
    """n_requests prompts at `concurrency` in flight. Returns (samples, steady window (t0, t1), retries)."""
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(n_requests):
        queue.put_nowait(next(prompts))
    samples: list[Sample] = []
    started, drained, retries = [], [], []

    async def one(messages):
        t0 = time.monotonic()
        return t0, await complete(client, spec, messages, stream=True, record_times=True)

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
            try:  # same fault handling as generate; retries are counted in the level's stats
                t0, done = await call_with_retries(lambda: one(messages), RETRY_ATTEMPTS,
                                                   on_retry=lambda f: retries.append(f.reason))
            except Exception as exc:  # noqa: BLE001 - one line for the user
                raise StageError(f"assess: a request failed: {classify(exc).reason}") from None
            samples.append(Sample(t0, time.monotonic(), done.ttft_s, done.completion_tokens or len(done.token_times),
                                  done.token_times, done.reasoning, done.content))

    t_begin = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    t_end = time.monotonic()
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
