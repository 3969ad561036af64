"""The async loop of generate: `concurrency` workers take prompts from a bounded queue, send them to the server pool,
retry faults, and hand finished rows to the completion store in small, frequent shards.

Stopping: the first SIGINT/SIGTERM stops sending and gives in-flight requests a grace period; what finished is
written in every case.
"""
from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass

import orjson

from drafter_data.generation.progress import Counters, Progress
from drafter_data.server import client as sc
from drafter_data.server.faults import RetryBudget, classify
from drafter_data.server.pool import ServerPool
from drafter_data.server.request import RequestSpec

FLUSH_INTERVAL_S = 2.0  # a kill loses at most this much of finished work, plus what is in flight
COMPACT_INTERVAL_S = 600.0  # merge the small shards of a days-long run as it goes
METRICS_INTERVAL_S = 15.0


@dataclass
class RunSettings:
    concurrency: int
    stream: bool
    max_attempts: int
    shard_rows: int
    grace_s: float
    target: str

    @classmethod
    def from_config(cls, cfg) -> RunSettings:
        g = cfg.generate
        return cls(concurrency=int(cfg.generation.concurrency), stream=bool(g.get("stream", True)),
                   max_attempts=int(g.max_attempts), shard_rows=int(g.shard_rows), grace_s=float(g.grace_period_s),
                   target=str(cfg.target.name))


class Runner:
    def __init__(self, spec: RequestSpec, settings: RunSettings, pool: ServerPool, store, errors, run,
                 assessed_tok_s: float | None = None):
        self.spec, self.settings, self.pool, self.store, self.errors, self.run = \
            spec, settings, pool, store, errors, run
        self.row_extra = {"model": spec.model, "thinking": spec.thinking, "target": settings.target, "turn": 0}
        self.pending: list[dict] = []
        self.written_keys: set[str] = set()
        self.c = Counters()
        self.progress = Progress(0, self.c, assessed_tok_s)
        self.stopping = asyncio.Event()
        self.signal: int | None = None

    async def one(self, item: dict) -> None:
        """One prompt until it is a completion (pending, written at the next flush) or a line in errors.jsonl.
        A server that cannot be reached costs no attempt: the request waits for a server (pool.acquire)."""
        budget = RetryBudget(self.settings.max_attempts)
        tools = orjson.loads(item["tools"]) if item.get("tools") else None
        while True:
            server = await self.pool.acquire()
            server.outstanding += 1
            try:
                done = await sc.complete(server.client, self.spec, item["messages"], tools,
                                         stream=self.settings.stream)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every fault is classified below
                fault = classify(exc)
            else:
                self.pool.succeeded(server)
                self.record(item, done)
                return
            finally:
                server.outstanding -= 1
            self.c.retries += 1
            if fault.kind == "server_down":
                self.pool.failed(server, hard=True)
                continue
            if fault.kind != "permanent":
                self.pool.failed(server, hard=False)
            wait = budget.next_wait(fault)
            if wait is None:
                reason = fault.reason if fault.kind == "permanent" else \
                    f"gave up after {budget.attempts} attempts: {fault.reason}"
                return self.error(item, reason, budget.attempts)
            await asyncio.sleep(wait)

    def record(self, item: dict, done: sc.Completion) -> None:
        self.pending.append({
            "prompt_id": item["prompt_id"], "source": item["source"], "messages": item["messages"],
            "tools": item.get("tools"), "reasoning": done.reasoning, "content": done.content,
            "finish_reason": done.finish_reason, "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens, "length_stop_in": done.length_stop_in,
            "request_key": item["request_key"], "latency_s": round(done.latency_s, 4), **self.row_extra,
        })
        self.c.done += 1
        self.c.output_tokens += done.completion_tokens
        self.c.latencies.append(done.latency_s)
        if len(self.pending) >= self.settings.shard_rows:
            self.flush()

    def error(self, item: dict, reason: str, attempts: int) -> None:
        self.c.errors += 1
        self.errors.add({"prompt_id": item["prompt_id"], "request_key": item["request_key"], "reason": reason,
                         "attempts": attempts, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})

    def flush(self) -> None:
        rows, self.pending = self.pending, []
        self.store.write(rows)
        self.written_keys.update(r["request_key"] for r in rows)

    async def worker(self, queue: asyncio.Queue) -> None:
        while not self.stopping.is_set():
            item = await queue.get()
            if item is None:
                return
            await self.one(item)

    async def produce(self, todo, queue: asyncio.Queue, n_workers: int) -> None:
        for item in todo:
            await queue.put(item)
        for _ in range(n_workers):
            await queue.put(None)

    async def run_all(self, todo, total: int) -> None:
        """Runs every prompt of `todo` (an iterator of `total`). On a stop request the producer is cancelled and the
        workers get the grace period; pending rows are flushed in every case."""
        conc = self.settings.concurrency
        queue: asyncio.Queue = asyncio.Queue(maxsize=conc * 2)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop, sig)
        progress = self.progress
        progress.start(total)
        workers = [asyncio.create_task(self.worker(queue)) for _ in range(conc)]
        producer = asyncio.create_task(self.produce(todo, queue, conc))
        ticker = asyncio.create_task(self.tick(progress))
        stop_waiter = asyncio.create_task(self.stopping.wait())
        all_workers = asyncio.gather(*workers)
        try:
            await asyncio.wait([all_workers, stop_waiter], return_when=asyncio.FIRST_COMPLETED)
            if self.stopping.is_set():
                producer.cancel()
                _, still = await asyncio.wait(workers, timeout=self.settings.grace_s)
                for w in still:
                    w.cancel()
            elif all_workers.exception() is not None:
                raise all_workers.exception()
        finally:
            for task in (producer, ticker, stop_waiter, *workers):
                task.cancel()
            await asyncio.gather(producer, ticker, stop_waiter, *workers, return_exceptions=True)
            self.flush()
            progress.close()

    def request_stop(self, sig) -> None:
        if not self.stopping.is_set():
            self.signal = sig
            print(f"\n{signal.Signals(sig).name}: stopping; in-flight requests get {self.settings.grace_s:.0f} s",
                  file=sys.stderr)
        self.stopping.set()

    async def tick(self, progress: Progress) -> None:
        """Once a second: the progress bar; every FLUSH_INTERVAL_S the pending rows to disk; every
        COMPACT_INTERVAL_S a compaction of small shards; metrics to MLflow in batches."""
        last_flush = last_compact = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            progress.update()
            if now - last_flush >= FLUSH_INTERVAL_S and self.pending:
                self.flush()
                last_flush = now
            if now - last_compact >= COMPACT_INTERVAL_S:
                self.store.compact()
                last_compact = now
            self.run.metrics(progress.live_metrics(), step=int(progress.elapsed()), flush_every_s=METRICS_INTERVAL_S)
