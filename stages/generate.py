"""generate: prompts in; the target's own completions (reasoning + answer) out, exactly once per prompt.

Survives days of running: faults are retried with backoff (a server that goes away is waited for, not burned
through), shards are complete or absent after any kill, a re-run sends only what is missing, and a re-run with other
generation params moves the old rows aside instead of reusing them. Ctrl-C/SIGTERM: stop sending, give in-flight
requests a grace period, write what finished, exit non-zero.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
from tqdm import tqdm

from drafter_data import server_client as sc
from drafter_data.completion_store import CompletionStore, ErrorLog
from drafter_data.config import StageError, run_stage
from drafter_data.local_server import local_server
from drafter_data.parquet_io import iter_batches, shard_paths
from drafter_data.tracking import stage_run

FLUSH_INTERVAL_S = 2.0  # a kill loses at most this much of finished work, plus what is in flight
COMPACT_INTERVAL_S = 600.0  # merge the small shards of a days-long run as it goes


def request_key(prompt_id: str, identity: bytes) -> str:
    """A completion's identity: the prompt (prompt_id is the content hash of its messages and tools) and everything
    else that determines the answer."""
    return hashlib.blake2b(prompt_id.encode() + b"\0" + identity, digest_size=16).hexdigest()


def identity_of(cfg) -> dict:
    """Everything besides the prompt that determines a completion: the target and the request's params."""
    return {"target": cfg.target.name, **sc.request_params(cfg.target, cfg.generation, cfg.server.model)}


def current_keys(paths: list[Path], identity: bytes) -> set[str]:
    """The request keys of every input prompt; reads the prompt_id column only (fast over millions)."""
    keys = set()
    for batch in iter_batches(paths, columns=["prompt_id"], batch_size=65536):
        keys.update(request_key(pid, identity) for pid in batch.column(0).to_pylist())
    return keys


def iter_todo(paths: list[Path], identity: bytes, done: set[str]):
    """The input prompts without a completion yet, in input order; Python rows are built only for those."""
    for batch in iter_batches(paths, columns=["prompt_id", "source", "messages", "tools"], batch_size=4096):
        keys = [request_key(pid, identity) for pid in batch.column(0).to_pylist()]
        todo = [i for i, k in enumerate(keys) if k not in done]
        if todo:
            for i, row in zip(todo, batch.take(todo).to_pylist()):
                row["request_key"] = keys[i]
                yield row


def assessed_tokens_per_s(cfg) -> float | None:
    """The best output tok/s the assess stage measured for this server, if it has run."""
    output = (cfg.get("assess") or {}).get("output")
    try:
        return float(json.loads((Path(output) / "metrics.json").read_text())["best"]["output_tokens_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class ServerState:
    url: str
    client: object
    outstanding: int = 0
    failures: int = 0
    down_until: float = 0.0


@dataclass
class Counters:
    done: int = 0
    errors: int = 0
    retries: int = 0
    output_tokens: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=2000))  # the recent ones, for percentiles


class ServerPool:
    """Requests go to the healthy server with the fewest outstanding; a failing one is set aside for a while."""

    def __init__(self, states: list[ServerState], down_timeout_s: float):
        self.states = states
        self.down_timeout_s = down_timeout_s
        self.last_success = time.monotonic()

    async def acquire(self) -> ServerState:
        while True:
            now = time.monotonic()
            up = [s for s in self.states if s.down_until <= now]
            if up:
                return min(up, key=lambda s: s.outstanding)
            if now - self.last_success > self.down_timeout_s:
                raise StageError(f"no server answered for {self.down_timeout_s:.0f} s "
                                 f"({', '.join(s.url for s in self.states)}); finished rows are saved, re-run to resume")
            await asyncio.sleep(min(s.down_until for s in self.states) - now + 0.01)

    def failed(self, s: ServerState, hard: bool) -> None:
        s.failures += 1
        if hard or s.failures >= 3:
            s.down_until = time.monotonic() + min(60.0, 0.5 * 2 ** min(s.failures, 7))

    def succeeded(self, s: ServerState) -> None:
        s.failures = 0
        s.down_until = 0.0
        self.last_success = time.monotonic()


class Generator:
    def __init__(self, cfg, pool: ServerPool, store: CompletionStore, errors: ErrorLog, run):
        g = cfg.generate
        self.cfg, self.pool, self.store, self.errors, self.run = cfg, pool, store, errors, run
        self.params = sc.request_params(cfg.target, cfg.generation, cfg.server.model)
        self.thinking = bool(cfg.generation.thinking)
        self.stream = bool(g.get("stream", True))
        self.max_attempts = int(g.max_attempts)
        self.shard_rows = int(g.shard_rows)
        self.grace_s = float(g.grace_period_s)
        self.row_extra = {"model": cfg.server.model, "thinking": self.thinking, "target": cfg.target.name}
        self.pending: list[dict] = []
        self.written_keys: set[str] = set()
        self.c = Counters()
        self.stopping = asyncio.Event()
        self.signal: int | None = None
        self.assessed_tok_s = assessed_tokens_per_s(cfg)

    async def one(self, item: dict) -> None:
        attempt = 0
        while True:
            server = await self.pool.acquire()
            server.outstanding += 1
            try:
                done = await sc.complete(server.client, item["messages"], self.params, self.thinking, self.stream,
                                         orjson.loads(item["tools"]) if item.get("tools") else None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every fault is classified below
                fault = sc.classify(exc)
            else:
                self.pool.succeeded(server)
                self.record(item, done)
                return
            finally:
                server.outstanding -= 1
            self.c.retries += 1
            if fault.kind == "server_down":
                self.pool.failed(server, hard=True)
                continue  # not the request's fault: wait for a server, do not count an attempt
            if fault.kind == "permanent":
                return self.error(item, fault.reason, attempt + 1)
            self.pool.failed(server, hard=False)
            attempt += 1
            if attempt >= self.max_attempts:
                return self.error(item, f"gave up after {attempt} attempts: {fault.reason}", attempt)
            await asyncio.sleep(sc.backoff_s(attempt, retry_after=fault.retry_after_s))

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
        if len(self.pending) >= self.shard_rows:
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
        conc = int(self.cfg.generation.concurrency)
        queue: asyncio.Queue = asyncio.Queue(maxsize=conc * 2)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop, sig)
        workers = [asyncio.create_task(self.worker(queue)) for _ in range(conc)]
        producer = asyncio.create_task(self.produce(todo, queue, conc))
        ticker = asyncio.create_task(self.tick(total))
        stop_waiter = asyncio.create_task(self.stopping.wait())
        all_workers = asyncio.gather(*workers)
        try:
            await asyncio.wait([all_workers, stop_waiter], return_when=asyncio.FIRST_COMPLETED)
            if self.stopping.is_set():
                producer.cancel()
                _, still = await asyncio.wait(workers, timeout=self.grace_s)
                for w in still:
                    w.cancel()
            elif all_workers.exception() is not None:
                raise all_workers.exception()
        finally:
            for task in (producer, ticker, stop_waiter, *workers):
                task.cancel()
            await asyncio.gather(producer, ticker, stop_waiter, *workers, return_exceptions=True)
            self.flush()

    def request_stop(self, sig) -> None:
        if not self.stopping.is_set():
            self.signal = sig
            print(f"\n{signal.Signals(sig).name}: stopping; in-flight requests get {self.grace_s:.0f} s",
                  file=sys.stderr)
        self.stopping.set()

    async def tick(self, total: int) -> None:
        bar = tqdm(total=total, unit="req", desc="generate", file=sys.stderr, dynamic_ncols=True,
                   mininterval=1.0, disable=None)
        t0, shown = time.monotonic(), 0
        last_flush = last_compact = t0
        try:
            while True:
                await asyncio.sleep(1.0)
                now = time.monotonic()
                bar.update(self.c.done + self.c.errors - shown)
                shown = self.c.done + self.c.errors
                tok_s = self.c.output_tokens / max(now - t0, 1e-9)
                eta_h, projected_h = self.eta_hours(total, now - t0)
                bar.set_postfix(tok_s=f"{tok_s:.0f}", errors=self.c.errors, retries=self.c.retries,
                                eta_h=f"{eta_h:.2f}" if eta_h is not None else "-",
                                assessed_h=f"{projected_h:.2f}" if projected_h is not None else "-", refresh=False)
                if now - last_flush >= FLUSH_INTERVAL_S and self.pending:
                    self.flush()
                    last_flush = now
                if now - last_compact >= COMPACT_INTERVAL_S:
                    self.store.compact()
                    last_compact = now
                self.run.metrics({**self.metrics(now - t0), "eta_hours": eta_h, "assessed_eta_hours": projected_h},
                                 step=int(now - t0), flush_every_s=15.0)
        finally:
            bar.update(self.c.done + self.c.errors - shown)
            bar.close()

    def eta_hours(self, total: int, elapsed: float) -> tuple[float | None, float | None]:
        """Hours left at the rate seen so far, and as the assessment's measured tok/s projects them."""
        left = total - self.c.done - self.c.errors
        eta = left / (self.c.done / elapsed) / 3600 if self.c.done and elapsed > 0 else None
        projected = None
        if self.assessed_tok_s and self.c.done:
            projected = left * (self.c.output_tokens / self.c.done) / self.assessed_tok_s / 3600
        return eta, projected

    def metrics(self, elapsed: float) -> dict:
        lat = np.asarray(self.c.latencies) if self.c.latencies else None
        return {
            "completions": self.c.done, "errors": self.c.errors, "retries": self.c.retries,
            "output_tokens_per_s": self.c.output_tokens / max(elapsed, 1e-9),
            "requests_per_s": self.c.done / max(elapsed, 1e-9),
            "latency_p50_s": float(np.percentile(lat, 50)) if lat is not None else None,
            "latency_p99_s": float(np.percentile(lat, 99)) if lat is not None else None,
            "assessed_output_tokens_per_s": self.assessed_tok_s,
        }


async def _generate(cfg, urls: list[str], run) -> int:
    g = cfg.generate
    in_paths = shard_paths(Path(g.input))
    if not in_paths:
        raise StageError(f"no prompt shards (*.parquet) in {Path(g.input).resolve()}; run prepare first")
    ident = identity_of(cfg)
    identity = orjson.dumps(ident, option=orjson.OPT_SORT_KEYS)
    current = current_keys(in_paths, identity)
    store = CompletionStore(Path(g.output))
    done = store.scan(current)
    if store.stale_rows:
        print(f"moved {store.stale_rows} completions made with other generation params or for prompts no longer in "
              f"the input to {store.stale_dir}", file=sys.stderr)
    todo_n = len(current) - len(done)
    print(f"{len(current)} prompts: {len(done)} already done, {todo_n} to generate", file=sys.stderr)
    key = sc.api_key(cfg.server)
    conc = int(cfg.generation.concurrency)
    states = [ServerState(u, sc.make_client(u, key, conc, float(g.request_timeout_s))) for u in urls]
    for s in states:
        params = {k: v for k, v in ident.items() if k != "target"}
        await sc.preflight(s.client, s.url, cfg.server.model, params, bool(cfg.generation.thinking),
                           bool(g.get("stream", True)))
    errors = ErrorLog(Path(g.output) / "errors.jsonl")
    gen = Generator(cfg, ServerPool(states, float(g.server_down_timeout_s)), store, errors, run)
    t0 = time.monotonic()
    todo = iter_todo(in_paths, identity, done)
    try:
        await gen.run_all(todo, todo_n)
    finally:
        elapsed = time.monotonic() - t0
        store.compact()  # keeps every row: what is done is what was done plus this run's completions
        all_done = done | gen.written_keys
        n_errors = errors.close(all_done)
        for s in states:
            await s.client.close()
        summary = {**gen.metrics(elapsed), "elapsed_s": elapsed, "prompts": len(current), "done_total": len(all_done),
                   "failed_total": n_errors, "stale_moved": store.stale_rows}
        (Path(g.output) / "run.json").write_text(json.dumps(summary, indent=2))
        run.artifact(Path(g.output) / "run.json")
        run.artifact(Path(g.output) / "errors.jsonl")
        run.metrics({**gen.metrics(elapsed), "done_total": len(all_done), "failed_total": n_errors})
        print(f"generate: {gen.c.done} completions this run ({len(all_done)}/{len(current)} done), "
              f"{gen.c.errors} failed for good, {gen.c.retries} retries, "
              f"{gen.c.output_tokens / max(elapsed, 1e-9):.1f} output tok/s", file=sys.stderr)
    if gen.stopping.is_set():
        return 128 + int(gen.signal or signal.SIGINT)
    return 0


def main(cfg) -> int:
    with stage_run("generate", cfg) as run:
        with local_server(cfg.server) as urls:
            return asyncio.run(_generate(cfg, sc.base_urls(cfg.server, urls), run))


if __name__ == "__main__":
    run_stage(main)
