"""What a generate run has done so far: counters, the live progress bar (rate, concurrency, ETA, ETA against the
assessment, and whether the client itself is the limit), the metrics sent to MLflow, and the time series behind the
throughput/concurrency plot."""
from __future__ import annotations

import json
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

SERIES_EVERY_S = 5.0
CLIENT_WINDOW_S = 10.0
CLIENT_BOUND_CORES = 0.75  # the event loop's CPU over CLIENT_WINDOW_S, in cores, at which the client is the limit: it
# does not reach 1.0 (other threads share the interpreter lock); against an instant server it ran at 0.84-0.87
CLIENT_WAY_PAST = ("the client is the limit: generate.stream=false (an unstreamed answer costs the client ~1/10 the "
                   "CPU per token), or more generate processes (the input split into shards, one process each)")


@dataclass
class Counters:
    done: int = 0
    errors: int = 0
    retries: int = 0
    retry_reasons: Counter = field(default_factory=Counter)  # the passing faults behind them, by reason
    withdrawn: int = 0  # requests withdrawn when auto lowered a server's level (sent again, no attempt lost)
    withdrawn_chunks: int = 0  # ... and the chunks of output they had streamed, lost (a token each on SGLang, vLLM)
    output_tokens: int = 0
    stopped_by_error: int = 0  # conversations whose later turns were lost with a turn that failed for good
    stopped_at_length: int = 0  # conversations ended by a turn cut at max_tokens (its context would be cut)
    stopped_at_tool_call: int = 0  # conversations ended by a tool call (no tool is run)
    finished_length: int = 0  # rows cut by max_tokens
    thinking_without_reasoning: int = 0  # thinking-on answers with no reasoning (kept: some prompts need none)
    unnamed_model: int = 0  # answers that named no model, so nothing checked they came from server.model
    conversations: int = 0  # conversations settled in this run (every turn answered, or ended early)
    # answers that finished with every slot busy, and their seconds per slot (latency / level): the steady state,
    # as assess measures it (not the last requests' drain); Little's law gives their tok/s at the level
    steady_tokens: int = 0
    steady_slot_s: float = 0.0
    latencies: deque = field(default_factory=lambda: deque(maxlen=2000))  # the recent ones, for percentiles
    ttfts: deque = field(default_factory=lambda: deque(maxlen=2000))


@dataclass
class Assessment:
    """What assess measured (optional: generate reads it for the ETA, the throughput check and auto's start), when
    it measured the same server: the same model, and the same URL or both the embedded server."""

    tokens_per_s: float | None = None
    concurrency: int | None = None
    url: str | None = None  # the one server assess measured (its first URL)
    local: bool = False  # ... or the embedded server

    def measured(self, url: str, local: bool) -> bool:
        """Whether this assessment is of the server at `url` (auto starts only that one at the assessed level)."""
        return self.concurrency is not None and (url == self.url or (local and self.local))

    @classmethod
    def read(cls, metrics_path: str | None, server: dict) -> Assessment:
        try:
            metrics = json.loads(Path(metrics_path).read_text())
            best, measured = metrics["best"], metrics["server"]
        except (OSError, ValueError, KeyError, TypeError):
            return cls()
        same = measured.get("model") == server["model"] and (
            measured.get("url") in server["urls"] or measured.get("kind") == server["kind"] == "local")
        if not same:
            return cls()
        return cls(float(best["output_tokens_per_s"]), int(best["concurrency"]), measured.get("url"),
                   measured.get("kind") == "local")


class ClientLoad:
    """The CPU the event loop's thread (every request, parse and write of generate) used over the last
    CLIENT_WINDOW_S, in cores: at CLIENT_BOUND_CORES, the client, not the servers, sets the pace."""

    def __init__(self):
        self.samples: deque = deque([(time.monotonic(), time.thread_time())])
        self.cores = 0.0
        self.peak = 0.0
        self.bound_s = 0.0  # seconds of the run spent client-bound
        self.ever_bound = False

    def sample(self) -> float:
        """Call from the event loop's thread about once a second."""
        now, cpu = time.monotonic(), time.thread_time()
        last_t = self.samples[-1][0]
        self.samples.append((now, cpu))
        while len(self.samples) > 2 and now - self.samples[1][0] >= CLIENT_WINDOW_S:
            self.samples.popleft()
        t0, c0 = self.samples[0]
        if now - t0 >= CLIENT_WINDOW_S / 2:
            self.cores = (cpu - c0) / (now - t0)
            self.peak = max(self.peak, self.cores)
            if self.bound:
                self.bound_s += now - last_t
                self.ever_bound = True
        return self.cores

    @property
    def bound(self) -> bool:
        return self.cores >= CLIENT_BOUND_CORES


class Progress:
    def __init__(self, counters: Counters, assessed: Assessment, servers: int = 1):
        self.c, self.assessed, self.servers = counters, assessed, servers
        self.total = 0
        self.t0 = time.monotonic()
        self.t_end: float | None = None  # the request phase's end: the run's rates leave out the writing after it
        self._shown = 0
        self.bar = None
        self.concurrency = 0
        self.series: list[tuple[float, int, float, float | None]] = []  # (s, concurrency, tok/s, ttft p50)
        self._last_point = (0.0, 0)
        self.client = ClientLoad()
        self._cpu0 = time.thread_time()

    def start(self, total: int, stream=None) -> None:
        """The clock and the bar start with the run (after resume and preflight). On a terminal, a bar of fixed
        width with short fields (it fits 120 columns); without one (a log file, nohup, a CI job), a line every
        LOG_EVERY_S."""
        self.total, self.t0, self._cpu0 = total, time.monotonic(), time.thread_time()
        self.client = ClientLoad()
        self.stream = stream or sys.stderr
        self._logged = time.monotonic()
        if getattr(self.stream, "isatty", lambda: False)():
            self.bar = tqdm(total=total, unit="conv", desc="generate", file=self.stream, mininterval=1.0,
                            unit_scale=True, bar_format="{desc} {percentage:3.0f}%|{bar:16}| {n_fmt}/{total_fmt} "
                                                         "{postfix}")

    def elapsed(self) -> float:
        return (self.t_end or time.monotonic()) - self.t0

    def stop(self) -> None:
        """The request phase ended (every request answered, or the run stopping): the clock stops, so the final
        flush, compaction and closing the clients do not count in the run's requests/s and tok/s."""
        if self.t_end is None:
            self.t_end = time.monotonic()
            self._cores_run = (time.thread_time() - self._cpu0) / max(self.t_end - self.t0, 1e-9)

    def update(self, finished: int, concurrency: int) -> None:
        """finished: conversations done or given up so far in this run (from the event loop's thread)."""
        self.concurrency = concurrency
        was_bound = self.client.ever_bound
        if self.t_end is None:
            self.client.sample()
        if self.client.ever_bound and not was_bound:
            tqdm.write(f"generate's client uses {self.client.cores:.2f} of a core: {CLIENT_WAY_PAST}", file=sys.stderr)
        if self.bar is not None:
            self.bar.update(finished - self._shown)
            self.bar.set_postfix_str(self.fields(finished), refresh=False)
        elif time.monotonic() - self._logged >= self.log_every_s:
            self._logged = time.monotonic()
            print(f"generate: {finished}/{self.total} conversations, {self.fields(finished)}", file=self.stream,
                  flush=True)
        self._shown = finished
        self._add_point()

    log_every_s = 30.0

    def fields(self, finished: int) -> str:
        """The figures beside the bar, short: level, tok/s, errors/retries, ETA (and the assessment's), client CPU."""
        eta_h, projected_h = self.eta_hours(finished)
        client = f"cpu {self.client.cores:.2f}" + (" CLIENT-BOUND" if self.client.bound else "")
        return (f"c={self.concurrency} {_short(self.tokens_per_s())} tok/s err {_short(self.c.errors)} retry "
                f"{_short(self.c.retries)} eta {_hours(eta_h)}h/{_hours(projected_h)}h {client}")

    def _add_point(self) -> None:
        now, (t_last, tokens_last) = self.elapsed(), self._last_point
        if now - t_last >= SERIES_EVERY_S:
            rate = (self.c.output_tokens - tokens_last) / (now - t_last)
            ttft = float(np.median(list(self.c.ttfts)[-64:])) if self.c.ttfts else None
            self.series.append((now, self.concurrency, rate, ttft))
            self._last_point = (now, self.c.output_tokens)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def tokens_per_s(self) -> float:
        return self.c.output_tokens / max(self.elapsed(), 1e-9)

    def eta_hours(self, finished: int) -> tuple[float | None, float | None]:
        """Hours left at the rate seen so far, and as the assessment's measured tok/s projects them."""
        elapsed = self.elapsed()
        left = self.total - finished
        eta = left / (finished / elapsed) / 3600 if finished and elapsed > 0 else None
        projected = None
        if self.assessed.tokens_per_s and self.c.done and finished:
            per_conv = self.c.output_tokens / finished
            projected = left * per_conv / (self.assessed.tokens_per_s * self.servers) / 3600
        return eta, projected

    def metrics(self) -> dict:
        elapsed = max(self.elapsed(), 1e-9)
        lat = np.asarray(self.c.latencies) if self.c.latencies else None
        assessed = self.assessed.tokens_per_s * self.servers if self.assessed.tokens_per_s else None
        steady = self.c.steady_tokens / self.c.steady_slot_s if self.c.steady_slot_s > 0 else None
        return {
            "completions": self.c.done, "errors": self.c.errors, "retries": self.c.retries,
            "withdrawn_requests": self.c.withdrawn, "withdrawn_output_chunks": self.c.withdrawn_chunks,
            "stopped_by_error": self.c.stopped_by_error, "stopped_at_length": self.c.stopped_at_length,
            "stopped_at_tool_call": self.c.stopped_at_tool_call,
            "thinking_without_reasoning": self.c.thinking_without_reasoning,
            "answers_naming_no_model": self.c.unnamed_model,
            "length_cut_share": self.c.finished_length / self.c.done if self.c.done else None,
            "output_tokens_per_s": self.tokens_per_s(),
            "requests_per_s": self.c.done / elapsed,
            "latency_p50_s": float(np.percentile(lat, 50)) if lat is not None else None,
            "latency_p99_s": float(np.percentile(lat, 99)) if lat is not None else None,
            "ttft_p50_s": float(np.median(self.c.ttfts)) if self.c.ttfts else None,
            "steady_output_tokens_per_s": steady,
            "assessed_output_tokens_per_s": assessed,
            # real / projected throughput for the same servers: is the assessment's projection to be trusted? The
            # steady rate, as assess's (a short run's whole-run rate is mostly its first wave and its drain); none
            # when no answer finished with every slot busy (fewer conversations than the level)
            "throughput_vs_assessed": steady / assessed if assessed and steady is not None else None,
            # the client's own ceiling: the event loop's CPU in cores over the run, its peak over CLIENT_WINDOW_S,
            # and the share of the run it was the limit (at CLIENT_BOUND_CORES)
            "client_cpu_cores": (time.thread_time() - self._cpu0) / elapsed if self.t_end is None else self._cores_run,
            "client_cpu_cores_peak": self.client.peak,
            "client_bound_share": self.client.bound_s / elapsed,
        }

    def live_metrics(self) -> dict:
        """metrics() (whole-run averages) plus the figures of the moment: the level in flight and the output tok/s
        and TTFT of the last SERIES_EVERY_S."""
        eta_h, projected_h = self.eta_hours(self._shown)
        now = self.series[-1] if self.series else None
        return {**self.metrics(), "concurrency": self.concurrency, "eta_hours": eta_h,
                "assessed_eta_hours": projected_h, "output_tokens_per_s_now": now[2] if now else None,
                "ttft_p50_s_now": now[3] if now else None, "client_cpu_cores_now": self.client.cores,
                "client_bound": float(self.client.bound)}

    def plot(self, path: Path) -> bool:
        """Throughput and concurrency over the run as a PNG; False when the run was too short to plot."""
        if len(self.series) < 2:
            return False
        from drafter_data.plots import png_figure

        t, conc, rate, _ = (np.asarray(v, dtype=float) for v in zip(*[(p[0], p[1], p[2], 0.0) for p in self.series]))
        rate = smoothed(t, rate)
        with png_figure(path, size=(7, 3.5)) as ax:
            ax.plot(t / 60, rate, color="tab:blue", label=f"output tok/s (over {SMOOTH_S:.0f} s)")
            ax.set_xlabel("minutes")
            ax.set_ylabel("output tokens/s", color="tab:blue")
            right = ax.twinx()
            right.step(t / 60, conc, where="post", color="tab:orange", label="concurrency")
            right.set_ylabel("requests in flight (limit)", color="tab:orange")
            ax.set_title("generate: throughput and concurrency over time")
            ax.grid(alpha=0.3)
        return True


SMOOTH_S = 60.0


def smoothed(t: np.ndarray, rate: np.ndarray, window_s: float = SMOOTH_S) -> np.ndarray:
    """tok/s over the last window_s at each point: unstreamed answers count all their tokens at once, so a rate per
    SERIES_EVERY_S swings between 0 and a burst (it looked like an idle server)."""
    starts = np.concatenate([[0.0], t[:-1]])
    tokens = np.cumsum(rate * (t - starts))
    begin = np.searchsorted(t, t - window_s)
    before = np.where(begin > 0, tokens[np.maximum(begin - 1, 0)], 0.0)
    since = np.where(begin > 0, t[np.maximum(begin - 1, 0)], 0.0)
    return (tokens - before) / np.maximum(t - since, 1e-9)


def _hours(h: float | None) -> str:
    return "-" if h is None else f"{h:.2f}" if h < 10 else f"{h:.0f}"


def _short(x: float) -> str:
    """1234567 -> 1.2M: a figure of at most 5 characters."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.1f}{suffix}" if x < 10 * scale else f"{x / scale:.0f}{suffix}"
    return f"{x:.0f}"
