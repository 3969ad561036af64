"""The controllers concurrency=auto was chosen against, with LevelController's interface (level, started, arrived,
completed, tick, history) and answered(tokens, latency), for bench/concurrency_grid.py --controller gradient|aimd.
Latency-based, as published; the latency of an LLM request grows with its length, so both read seconds per output
token.

- GradientLimiter: Netflix concurrency-limits' Gradient2 (a TCP Vegas-like gradient): every second,
  gradient = clamp(TOLERANCE x long-term latency / short-term latency, 0.5, 1), new = level x gradient + sqrt(level),
  smoothed by 0.2.
- AimdLimiter: additive increase while latency is within 1.5x of the least seen (x1.1 + 1 per second of answers),
  multiplicative decrease (x0.8) past it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class _Latency:
    level: int
    low: int
    high: int
    clock: object = time.monotonic
    history: list = field(default_factory=list)
    _tokens: float = 0.0
    _seconds: float = 0.0

    def answered(self, tokens: int, latency_s: float) -> None:
        self._tokens += max(tokens, 1)
        self._seconds += latency_s

    def arrived(self, tokens: float, first_s: float | None = None) -> None:
        pass

    def completed(self, tokens: int, latency_s: float, first_s: float | None = None) -> None:
        pass

    def _per_token(self) -> float | None:
        if self._tokens < 8:
            return None
        value, self._tokens, self._seconds = self._seconds / self._tokens, 0.0, 0.0
        return value

    def _set(self, level: float) -> int | None:
        new = max(self.low, min(self.high, int(round(level))))
        changed, self.level = new != self.level, new
        self.history.append((self.clock(), new, 0.0))
        return new if changed else None


@dataclass
class GradientLimiter(_Latency):
    TOLERANCE = 1.5
    _long: float = 0.0
    _limit: float = 0.0

    def tick(self, in_flight: int) -> int | None:
        short = self._per_token()
        if short is None:
            return None
        self._limit = self._limit or float(self.level)
        self._long = short if not self._long else 0.99 * self._long + 0.01 * short
        gradient = max(0.5, min(1.0, self.TOLERANCE * self._long / short))
        self._limit = 0.8 * self._limit + 0.2 * (self._limit * gradient + math.sqrt(self._limit))
        return self._set(self._limit)


@dataclass
class AimdLimiter(_Latency):
    _least: float = 0.0
    _limit: float = 0.0

    def tick(self, in_flight: int) -> int | None:
        per_token = self._per_token()
        if per_token is None:
            return None
        self._limit = self._limit or float(self.level)
        self._least = min(self._least or per_token, per_token)
        if per_token <= 1.5 * self._least:
            self._limit = self._limit * 1.1 + 1
        else:
            self._limit *= 0.8
        return self._set(self._limit)
