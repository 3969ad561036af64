"""generation.concurrency=auto: each server's level (requests in flight) follows the server's best by itself.

A hill climb on measured output tokens/s, in log steps:
- after a change, wait for the requests of the old level to drain (`settle`: about one request's latency), then
  measure the tokens of the requests that finish during `window` (at least a few latencies long);
- better than the level before by more than the noise margin: keep going that way (the step grows back towards
  2x after two gains in a row, so a moved knee is found again quickly);
- worse, or not better while going up (a flat curve means requests only queue, TTFT climbs): turn around with half
  the step (never below MIN_STEP, so the climb keeps probing and follows a knee that moves mid-run).
A level ends up oscillating by one small step around the best; the first climb starts from the assessed best level
(assess's metrics.json) or, without an assessment, doubles from `start`.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

MIN_STEP = math.log(1.06)
MAX_STEP = math.log(2.0)
NOISE = 0.03  # relative throughput difference read as a real change


@dataclass
class Measurement:
    level: int
    tokens_per_s: float


@dataclass
class LevelController:
    level: int
    low: int
    high: int
    step: float = MAX_STEP
    direction: int = 1
    min_window_s: float = 3.0
    clock: object = time.monotonic
    history: list = field(default_factory=list)  # (time, level, tokens/s, ttft p50) per measured window
    _previous: Measurement | None = None
    _gains: int = 0
    _changed_at: float = 0.0
    _window_start: float | None = None
    _tokens: int = 0
    _latencies: deque = field(default_factory=lambda: deque(maxlen=64))
    _ttfts: deque = field(default_factory=lambda: deque(maxlen=64))

    def __post_init__(self):
        self.level = self._clamp(self.level)
        self._changed_at = self.clock()

    @classmethod
    def starting_at(cls, level: int | None, low: int, high: int, **kw) -> LevelController:
        """From the assessed best level (small steps around it), or from `low` doubling until the curve turns."""
        if level:
            return cls(level=level, low=low, high=high, step=math.log(1.25), **kw)
        return cls(level=max(low, min(high, 4)), low=low, high=high, **kw)

    def completed(self, tokens: int, latency_s: float, ttft_s: float | None) -> None:
        self._latencies.append(latency_s)
        if ttft_s is not None:
            self._ttfts.append(ttft_s)
        if self._window_start is not None:
            self._tokens += tokens

    def tick(self) -> int | None:
        """Called about once a second: returns the new level when it changes."""
        now = self.clock()
        typical = sorted(self._latencies)[len(self._latencies) // 2] if self._latencies else self.min_window_s
        if self._window_start is None:
            if now - self._changed_at >= min(typical, 60.0):
                self._window_start, self._tokens = now, 0
            return None
        if now - self._window_start < max(self.min_window_s, 2 * typical):
            return None
        measured = Measurement(self.level, self._tokens / (now - self._window_start))
        ttft = sorted(self._ttfts)[len(self._ttfts) // 2] if self._ttfts else None
        self.history.append((now, self.level, measured.tokens_per_s, ttft))
        return self._decide(measured, now)

    def _decide(self, measured: Measurement, now: float) -> int | None:
        previous, self._previous = self._previous, measured
        if previous is not None and previous.level != measured.level:
            gain = measured.tokens_per_s / max(previous.tokens_per_s, 1e-9) - 1
            went_up = measured.level > previous.level
            if gain > NOISE:
                self._gains += 1
                if self._gains >= 2:
                    self.step = min(MAX_STEP, self.step * 1.5)
            elif gain < -NOISE or went_up:
                self.direction = -1 if went_up else 1
                self.step = max(MIN_STEP, self.step / 2)
                self._gains = 0
        new = self._clamp(round(self.level * math.exp(self.direction * self.step)))
        if new == self.level:
            new = self._clamp(self.level + self.direction)
        if new == self.level:  # at a bound: probe the other way
            self.direction = -self.direction
            new = self._clamp(self.level + self.direction)
        self.level, self._changed_at, self._window_start = new, now, None
        return new

    def _clamp(self, level: int) -> int:
        return max(self.low, min(self.high, int(level)))
