"""What a generate run has done so far: counters, the live progress bar (rate, ETA, ETA against the assessment) and
the metrics sent to MLflow."""
from __future__ import annotations

import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm


@dataclass
class Counters:
    done: int = 0
    errors: int = 0
    retries: int = 0
    output_tokens: int = 0
    stopped_by_error: int = 0  # conversations whose later turns were lost with a turn that failed for good
    stopped_at_length: int = 0  # conversations ended by a turn cut at max_tokens (its context would be cut)
    stopped_at_tool_call: int = 0  # conversations ended by a tool call (no tool is run)
    latencies: deque = field(default_factory=lambda: deque(maxlen=2000))  # the recent ones, for percentiles


def assessed_tokens_per_s(metrics_path: str | None) -> float | None:
    """The best output tok/s the assess stage measured for this server, if it has run (optional: for the ETA)."""
    if not metrics_path:
        return None
    try:
        return float(json.loads(Path(metrics_path).read_text())["best"]["output_tokens_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Progress:
    def __init__(self, total: int, counters: Counters, assessed_tok_s: float | None):
        self.total, self.c, self.assessed_tok_s = total, counters, assessed_tok_s
        self.t0 = time.monotonic()
        self._shown = 0
        self.bar = None

    def start(self, total: int) -> None:
        """The clock and the bar start with the run (after resume and preflight)."""
        self.total, self.t0 = total, time.monotonic()
        self.bar = tqdm(total=total, unit="req", desc="generate", file=sys.stderr, dynamic_ncols=True,
                        mininterval=1.0, disable=None)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def update(self) -> None:
        finished = self.c.done + self.c.errors
        self.bar.update(finished - self._shown)
        self._shown = finished
        eta_h, projected_h = self.eta_hours()
        self.bar.set_postfix(tok_s=f"{self.c.output_tokens / max(self.elapsed(), 1e-9):.0f}", errors=self.c.errors,
                             retries=self.c.retries, eta_h=_hours(eta_h), assessed_h=_hours(projected_h),
                             refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.c.done + self.c.errors - self._shown)
            self.bar.close()

    def eta_hours(self) -> tuple[float | None, float | None]:
        """Hours left at the rate seen so far, and as the assessment's measured tok/s projects them."""
        elapsed = self.elapsed()
        left = self.total - self.c.done - self.c.errors
        eta = left / (self.c.done / elapsed) / 3600 if self.c.done and elapsed > 0 else None
        projected = None
        if self.assessed_tok_s and self.c.done:
            projected = left * (self.c.output_tokens / self.c.done) / self.assessed_tok_s / 3600
        return eta, projected

    def metrics(self) -> dict:
        elapsed = max(self.elapsed(), 1e-9)
        lat = np.asarray(self.c.latencies) if self.c.latencies else None
        return {
            "completions": self.c.done, "errors": self.c.errors, "retries": self.c.retries,
            "stopped_by_error": self.c.stopped_by_error, "stopped_at_length": self.c.stopped_at_length,
            "stopped_at_tool_call": self.c.stopped_at_tool_call,
            "output_tokens_per_s": self.c.output_tokens / elapsed,
            "requests_per_s": self.c.done / elapsed,
            "latency_p50_s": float(np.percentile(lat, 50)) if lat is not None else None,
            "latency_p99_s": float(np.percentile(lat, 99)) if lat is not None else None,
            "assessed_output_tokens_per_s": self.assessed_tok_s,
        }

    def live_metrics(self) -> dict:
        eta_h, projected_h = self.eta_hours()
        return {**self.metrics(), "eta_hours": eta_h, "assessed_eta_hours": projected_h}


def _hours(h: float | None) -> str:
    return f"{h:.2f}" if h is not None else "-"
