"""The async loop of generate: workers take conversations from a bounded queue and answer them turn by turn through
the server pool; finished rows are handed to the completion store in small, frequent shards.

Any task that fails (the producer reading the input, the ticker writing shards, a worker) stops the run with a
one-line reason, after what finished is saved. Signals: the first SIGINT/SIGTERM stops sending new requests and
gives in-flight ones `grace_s`; a second one stops at once.
"""
from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass

import orjson

from drafter_data.errors import StageError
from drafter_data.generation.conversation import Conversation, split_for_row
from drafter_data.generation.keys import turn_key
from drafter_data.generation.progress import Assessment, Counters, Progress
from drafter_data.redaction import redact_url
from drafter_data.server.client import Completion, complete
from drafter_data.server.faults import Fault, RetryBudget, backoff_s, classify
from drafter_data.server.pool import ServerPool, ServerState, sleep_unless
from drafter_data.server.request import RequestSpec
from drafter_data.tokens.chat_template import kwargs_text

FLUSH_INTERVAL_S = 2.0  # a kill loses at most this much of finished work, plus what is in flight
COMPACT_INTERVAL_S = 600.0  # merge the small shards of a days-long run as it goes
METRICS_INTERVAL_S = 15.0
WRITE_ATTEMPTS = 4  # a shard write that fails (disk full) is retried; then the run stops, rows kept in memory
MAX_RETRY_REASONS = 20  # kinds of passing fault counted apart in run.json (a reason may carry a request id)


@dataclass
class RunSettings:
    concurrency: int  # requests in flight; with auto, the most per server (generation.concurrency_max)
    stream: bool
    max_attempts: int
    shard_rows: int
    grace_s: float
    target: str
    max_connection_failures: int = 6
    max_backoff_s: float = 60.0
    max_run_wide_failures: int = 5
    max_failed_in_a_row: int = 10
    keep_reasoning: bool = False  # generation.history_reasoning == keep
    auto: bool = False  # generation.concurrency=auto: each server's level follows its throughput
    concurrency_min: int = 1

    @classmethod
    def from_config(cls, cfg) -> RunSettings:
        g, gen = cfg.generate, cfg.generation
        auto = str(gen.concurrency).lower() == "auto"
        high = int(gen.get("concurrency_max") or 256)
        if not auto and (not str(gen.concurrency).isdigit() or int(gen.concurrency) < 1):
            raise StageError(f"generation.concurrency={gen.concurrency!r}: give a number of requests in flight (>= 1) "
                             f"or auto")
        low = max(1, int(gen.get("concurrency_min") or 1))
        if auto and low > high:
            raise StageError(f"generation.concurrency_min={low} is above generation.concurrency_max={high}: "
                             f"concurrency=auto needs min <= max")
        return cls(concurrency=high if auto else int(gen.concurrency), stream=bool(g.get("stream", True)),
                   max_attempts=int(g.max_attempts), shard_rows=int(g.shard_rows), grace_s=float(g.grace_period_s),
                   target=str(cfg.target.name), max_connection_failures=int(g.get("max_connection_failures", 6)),
                   max_backoff_s=float(g.get("max_backoff_s", 60)),
                   max_run_wide_failures=int(g.get("max_run_wide_failures", 5)),
                   max_failed_in_a_row=int(g.get("max_failed_in_a_row", 10)),
                   keep_reasoning=gen.get("history_reasoning", "drop") == "keep", auto=auto,
                   concurrency_min=low)

    def workers(self, servers: int) -> int:
        return self.concurrency * servers if self.auto else self.concurrency


class Runner:
    def __init__(self, spec: RequestSpec, settings: RunSettings, pool: ServerPool, store, errors, run,
                 assessed: Assessment | None = None):
        self.spec, self.settings, self.pool, self.store, self.errors, self.run = \
            spec, settings, pool, store, errors, run
        self.pending: list[dict] = []
        self.saved = 0  # rows on disk (answers in `pending` are not, until a write succeeds)
        self.c = Counters()
        self.progress = Progress(self.c, assessed or Assessment(), servers=len(pool.states))
        self.stopping = asyncio.Event()  # no new requests (first signal, or a fatal fault)
        self.abort = asyncio.Event()  # stop now (second signal, or a fatal fault)
        self.fatal: str | None = None
        self.signal: int | None = None
        self.run_wide_streak = 0
        self.failed_streak = 0  # requests that failed for good since the last answer
        self._write_lock = asyncio.Lock()
        self._flush_due = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._tracking_errors: set[str] = set()

    # --- one conversation ------------------------------------------------------------------------------------

    async def converse(self, conv: Conversation) -> None:
        """Every turn left of one conversation, in order; a turn that fails for good, is cut by max_tokens, or
        ends in a tool call ends the conversation (no tool is run)."""
        while conv.turn < conv.turns and not self.stopping.is_set():
            sent = conv.messages_for_turn()
            done, via = await self.request(conv, sent)
            if done is None:
                if conv.failed:
                    self.c.conversations += 1
                    self.c.stopped_by_error += conv.turn + 1 < conv.turns
                return
            answer = self.record(conv, sent, done, via)
            if conv.turn + 1 >= conv.turns:
                self.c.conversations += 1
                return
            if done.finish_reason == "length" or done.finish_reason == "tool_calls" or done.tool_calls:
                self.c.conversations += 1
                if done.finish_reason == "length":
                    self.c.stopped_at_length += 1
                else:
                    self.c.stopped_at_tool_call += 1
                return
            conv.advance(sent, answer, self.settings.keep_reasoning,
                         turn_key(conv.key, conv.turn + 1, answer, self.settings.keep_reasoning))

    async def request(self, conv: Conversation, sent: list[dict]) -> tuple[Completion | None, str | None]:
        """One turn until it is answered: (the completion, how its token ids were asked for); (None, None) when it
        failed for good (written to errors.jsonl, conv.failed) or the run is stopping (left for the next run). A
        server that cannot be reached costs no attempt."""
        budget = RetryBudget(self.settings.max_attempts, self.settings.max_connection_failures,
                             self.settings.max_backoff_s)
        tools = conv.tools()
        while not self.stopping.is_set():
            server = await self.pool.acquire()
            if self.stopping.is_set():  # stopped while waiting for room: the freed slot starts nothing new
                self.pool.release(server)
                break
            spec = server.spec or self.spec
            controller = server.controller  # concurrency=auto measures the chunks of output as they arrive
            chunks = [0]  # of this request's output: lost if it is withdrawn

            def on_output(first_s=None, controller=controller, chunks=chunks):
                chunks[0] += 1
                controller.arrived(first_s=first_s)

            call = self.pool.send(server, complete(server.client, spec, sent, tools, thinking=conv.thinking,
                                                   stream=self.settings.stream,
                                                   on_output=on_output if controller else None))
            try:
                done = await call
            except asyncio.CancelledError:
                if not self.pool.withdrew(server, call):
                    raise
                self.c.withdrawn += 1  # the level went down: sent again, no attempt lost
                self.c.withdrawn_chunks += chunks[0]
                if controller is not None:  # its output so far is lost: a cost of the level it was sent at
                    controller.withdrawn(chunks[0])
                continue
            except Exception as exc:  # noqa: BLE001 - every fault is classified below
                fault = classify(exc).at(server.url)
            else:
                self.pool.succeeded(server)
                self.run_wide_streak = self.failed_streak = 0
                if controller is not None:
                    controller.completed(done.completion_tokens, done.latency_s, done.ttft_s)
                return done, spec.token_ids_via if done.completion_token_ids is not None else None
            finally:
                self.pool.release(server, call)
            self.c.retries += 1
            self.note_fault(server, fault)
            if fault.kind == "run_wide":
                if self.fatal is None:
                    self.note_retry(fault)
                await self.pause(min(backoff_s(self.run_wide_streak), self.settings.max_backoff_s))
                continue
            wait = budget.next_wait(fault)
            if wait is None:
                conv.failed = True
                reason = budget.gave_up(fault)
                self.error(conv, reason, budget.attempts + budget.connection_failures)
                self.failed_streak += 1
                if self.failed_streak >= self.settings.max_failed_in_a_row:
                    self.fail(f"{self.failed_streak} requests in a row failed for good and none was answered in "
                              f"between, so nothing gets through (generate.max_failed_in_a_row); the last: {reason}")
                return None, None
            self.note_retry(fault)
            await self.pause(wait)
        return None, None

    def note_retry(self, fault: Fault) -> None:
        """A fault whose request is sent again, counted by reason for run.json (`retry_reasons`, at most
        MAX_RETRY_REASONS kinds, the rest together); the first of each kind is said at once, so a bar showing
        retries has its cause on the screen. (`retries` also counts the faults that ended in errors.jsonl.)"""
        reason = redact_url(fault.reason)[:300]
        if reason not in self.c.retry_reasons:
            if len(self.c.retry_reasons) >= MAX_RETRY_REASONS:
                reason = "(other reasons)"
            else:
                print(f"\nretrying: {reason} (said once per kind; run.json counts them in retry_reasons)",
                      file=sys.stderr)
        self.c.retry_reasons[reason] += 1

    def note_fault(self, server: ServerState, fault: Fault) -> None:
        if fault.kind in ("unreachable", "dropped"):
            self.pool.failed(server, hard=True)
            return
        if fault.answered:
            self.pool.answered(server)
        if fault.kind == "retry":
            self.pool.failed(server, hard=False)
        if fault.kind == "run_wide":
            self.run_wide_streak += 1
            if self.run_wide_streak >= self.settings.max_run_wide_failures:
                self.fail(f"{self.run_wide_streak} requests in a row failed the same way, so no request can "
                          f"succeed: {fault.reason}")

    async def pause(self, seconds: float) -> None:
        """Sleeps, but wakes at once when the run stops (no new attempt starts during the grace period)."""
        await sleep_unless(self.stopping, seconds)

    def record(self, conv: Conversation, sent: list[dict], done: Completion, via: str | None) -> dict:
        messages, extras = split_for_row(sent)
        tool_calls = orjson.dumps(done.tool_calls).decode() if done.tool_calls else None
        key_hex = conv.key.hex()
        self.pending.append({
            "prompt_id": conv.prompt["prompt_id"], "source": conv.prompt["source"], "messages": messages,
            "tools": conv.prompt.get("tools"), "message_extras": extras, "turns": conv.turns, "turn": conv.turn,
            "reasoning": done.reasoning, "content": done.content, "finish_reason": done.finish_reason,
            "prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "tool_calls": tool_calls, "prompt_token_ids": done.prompt_token_ids,
            "completion_token_ids": done.completion_token_ids, "token_ids_via": via,
            "length_stop_in": done.length_stop_in,
            "request_key": key_hex, "parent_key": conv.parent_key.hex() if conv.parent_key else None,
            "model": done.model, "chat_template_kwargs": kwargs_text(self.spec.chat_template_kwargs(conv.thinking)),
            "thinking": conv.thinking, "target": self.settings.target,
            "latency_s": round(done.latency_s, 4),
        })
        self.errors.resolved(key_hex)
        self.c.done += 1
        self.c.output_tokens += done.completion_tokens
        self.c.finished_length += done.finish_reason == "length"
        self.c.thinking_without_reasoning += bool(conv.thinking and not done.reasoning)
        self.c.unnamed_model += not done.model
        self.c.latencies.append(done.latency_s)
        self.count_if_steady(done)
        if done.ttft_s is not None:
            self.c.ttfts.append(done.ttft_s)
        if len(self.pending) >= self.settings.shard_rows:
            self._flush_due.set()
        return {"reasoning": done.reasoning, "content": done.content, "tool_calls": tool_calls}

    def count_if_steady(self, done: Completion) -> None:
        """An answer that ran its whole life at one level with every slot busy counts towards the steady rate (its
        own slot is already released; with auto, only the servers not set aside count, as in `concurrency`)."""
        level = self.concurrency()
        servers = self.pool.up() if self.settings.auto else self.pool.states
        changed_at = max(s.limit_since for s in self.pool.states)  # an answer across a change of level is not steady
        if level and time.monotonic() - done.latency_s >= changed_at and \
                sum(s.outstanding for s in servers) + 1 >= level:
            self.c.steady_tokens += done.completion_tokens
            self.c.steady_slot_s += done.latency_s / level

    def error(self, conv: Conversation, reason: str, attempts: int) -> None:
        self.c.errors += 1
        self.errors.add({"prompt_id": conv.prompt["prompt_id"], "turn": conv.turn, "request_key": conv.key.hex(),
                         "reason": reason, "attempts": attempts, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})

    def fail(self, reason: str) -> None:
        """A fault that ends the run: stop at once, save what finished, exit non-zero with `reason`."""
        if self.fatal is None:
            self.fatal = reason
        self.stopping.set()
        self.abort.set()

    # --- writing ---------------------------------------------------------------------------------------------

    async def flush(self) -> None:
        """Pending rows to a new shard, off the event loop. Rows leave `pending` only once they are on disk; a write
        that keeps failing ends the run (StageError) with the count of answers not saved."""
        async with self._write_lock:
            rows = self.pending[:]
            self._flush_due.clear()  # rows that fill a shard during this write call for the next one
            if not rows:
                return
            for attempt in range(1, WRITE_ATTEMPTS + 1):
                try:
                    await self._write(rows)
                    break
                except OSError as exc:
                    if attempt == WRITE_ATTEMPTS:
                        raise StageError(f"cannot write completions to {self.store.dir} ({exc}); "
                                         f"{len(self.pending)} answers not saved; free space and re-run to "
                                         f"resume") from None
                    await asyncio.sleep(0.5 * 2 ** attempt)

    async def _write(self, rows: list[dict]) -> None:
        """One shard write in a thread. It cannot be abandoned half-way: if the flushing task is cancelled, the
        write is still awaited to its end (and its rows leave `pending`) before the cancel goes on."""
        write = asyncio.ensure_future(asyncio.to_thread(self.store.write, rows))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            await write
            self._written(rows)
            raise
        self._written(rows)

    def _written(self, rows: list[dict]) -> None:
        del self.pending[:len(rows)]
        self.saved += len(rows)

    async def compact(self) -> None:
        try:
            await asyncio.to_thread(self.store.compact)
        except OSError as exc:  # the rows are safe in their small shards; the next compaction tries again
            print(f"warning: compacting {self.store.dir} failed: {exc}", file=sys.stderr)

    def track(self, values: dict, step: int) -> None:
        """Metrics to MLflow; best-effort (StageRun sends them from its own thread, so this only queues them): a
        failure is reported once and never stops the run."""
        try:
            self.run.metrics(values, step=step, flush_every_s=METRICS_INTERVAL_S)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop generation
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            if message not in self._tracking_errors:
                self._tracking_errors.add(message)
                print(f"\nwarning: MLflow logging failed ({message}); generation goes on", file=sys.stderr)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def tick(self) -> None:
        """Once a second: the progress bar; pending rows to disk every FLUSH_INTERVAL_S (sooner when a shard is
        full), one write at a time in the background, so that a write the disk holds up stops neither the bar nor
        the levels; compaction every COMPACT_INTERVAL_S in the background; metrics to MLflow."""
        last_flush = last_compact = time.monotonic()
        writing: asyncio.Task | None = None
        while True:
            if writing is None:
                await sleep_unless(self._flush_due, 1.0)
            else:
                await asyncio.wait({writing}, timeout=1.0)
                if writing.done():
                    writing.result()  # a write that kept failing ends the run with its StageError
                    writing = None
            now = time.monotonic()
            self.follow_servers()
            self.progress.update(self.c.conversations, self.concurrency())
            due = self._flush_due.is_set() or (now - last_flush >= FLUSH_INTERVAL_S and self.pending)
            if writing is None and due:
                writing = self._spawn(self.flush(), "flush")
                # its failure is raised here at the next tick; if the run is ending first, the rows are still
                # pending and the final flush meets the same disk: nothing is left to report it unretrieved
                writing.add_done_callback(lambda task: task.cancelled() or task.exception())
                last_flush = now
            if now - last_compact >= COMPACT_INTERVAL_S and \
                    not any(t.get_name() == "compact" and not t.done() for t in self._background):
                self._spawn(self.compact(), "compact")
                last_compact = now
            self.track(self.progress.live_metrics(), int(self.progress.elapsed()))

    def follow_servers(self) -> None:
        """generation.concurrency=auto: each server's controller moves its level; the pool applies it. Not once the
        run is stopping: the requests in flight get their grace period (a lower level would withdraw some)."""
        if self.stopping.is_set():
            return
        for server in self.pool.states:
            if server.controller is not None:
                level = server.controller.tick(server.outstanding)
                if level is not None:
                    # unstreamed, the requests left after a withdrawal are the oldest: their answers, long under way,
                    # would end in the new level's first window and read as its rate
                    self.pool.set_limit(server, level, withdraw=server.controller.streams)

    def concurrency(self) -> int:
        """The level in flight now: fixed, or (auto) the sum over the servers that are up."""
        if not self.settings.auto:
            return self.settings.concurrency
        return sum(s.limit or 0 for s in self.pool.up())

    # --- the run ---------------------------------------------------------------------------------------------

    async def worker(self, queue: asyncio.Queue) -> None:
        while not self.stopping.is_set():
            conv = await queue.get()
            if conv is None:
                return
            await self.converse(conv)

    async def produce(self, todo, queue: asyncio.Queue, n_workers: int) -> None:
        for conv in todo:
            await queue.put(conv)
        for _ in range(n_workers):
            await queue.put(None)

    async def run_all(self, todo, total: int) -> None:
        """Every conversation of `todo` (an iterator of `total`). Raises StageError when a task failed or a fault
        ended the run; pending rows are flushed in every case."""
        loop = asyncio.get_running_loop()
        before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in before:
            loop.add_signal_handler(sig, self.on_signal, sig)
        n = self.settings.workers(len(self.pool.states))
        queue: asyncio.Queue = asyncio.Queue(maxsize=n * 2)
        self.progress.start(total)
        workers = [asyncio.create_task(self.worker(queue), name="worker") for _ in range(n)]
        producer = asyncio.create_task(self.produce(todo, queue, n), name="reading the input")
        ticker = asyncio.create_task(self.tick(), name="writing shards")
        try:
            await self.supervise(producer, ticker, workers)
        finally:
            self.progress.stop()
            tasks = [producer, ticker, *workers]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # a compaction in progress is waited for, not abandoned: its thread would go on under the final one
            await asyncio.gather(*self._background, return_exceptions=True)
            try:
                await self.flush()
            finally:
                self.progress.update(self.c.conversations, self.concurrency())  # the bar's last figures
                self.progress.close()
                for sig, handler in before.items():  # back to what the stage had (not the default: cleanup)
                    loop.remove_signal_handler(sig)
                    signal.signal(sig, handler)
        if self.fatal:
            raise StageError(self.fatal)

    async def supervise(self, producer: asyncio.Task, ticker: asyncio.Task, workers: list[asyncio.Task]) -> None:
        """Waits for the workers; returns at once when any task fails or on abort, and after the grace period
        once stopping."""
        loop = asyncio.get_running_loop()
        remaining, watched = set(workers), {producer, ticker}
        events = {asyncio.create_task(self.stopping.wait()), asyncio.create_task(self.abort.wait())}
        deadline = None
        try:
            while remaining and not self.abort.is_set():
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                done, _ = await asyncio.wait(remaining | watched | {e for e in events if not e.done()},
                                             timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for task in done & (remaining | watched):
                    if not task.cancelled() and task.exception() is not None:
                        self.fail(_one_line(task.get_name(), task.exception()))
                remaining -= done
                watched -= done
                if self.stopping.is_set() and deadline is None:
                    deadline = loop.time() + self.settings.grace_s
                    producer.cancel()
                if deadline is not None and loop.time() >= deadline:
                    return
        finally:
            for e in events:
                e.cancel()

    def on_signal(self, sig) -> None:
        name = signal.Signals(sig).name
        if self.stopping.is_set():
            print(f"\n{name} again: stopping now; finished rows are saved", file=sys.stderr)
            self.abort.set()
            return
        self.signal = sig
        print(f"\n{name}: no new requests; in-flight ones get up to {self.settings.grace_s:.0f} s to finish "
              f"({name} again to stop now)", file=sys.stderr)
        self.stopping.set()


def _one_line(task_name: str, exc: BaseException) -> str:
    if isinstance(exc, StageError):
        return str(exc)
    return f"{task_name} failed: {type(exc).__name__}: {exc}".splitlines()[0]

