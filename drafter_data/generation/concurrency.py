"""generation.concurrency=auto: each server's level (requests in flight) follows the server's best by itself.

A hill climb on the server's output tokens/s, in log steps:
- after a level change, only requests sent at the new level are measured; the rate comes from Little's law,
  tokens/s = (requests in flight) x (tokens per request) / (seconds per request), averaged over at least `level`
  such requests (a few seconds on a fast server, a few request lifetimes on a slow one). Unlike counting the tokens
  that happen to finish in a window, it has little noise, and queueing shows in it: requests that wait for a
  slot take longer, so a level past the server's capacity measures no better;
- better than the level before by more than NOISE: keep going that way (the step grows back towards 2x after two
  gains in a row, so a moved knee is found again quickly);
- worse, or not better while going up (a flat curve means requests only queue, TTFT climbs): turn around with half
  the step (never below MIN_STEP, so the climb keeps probing and follows a knee that moves mid-run);
- when fewer requests are in flight than the level allows (the end of the input), nothing is decided.
The first climb starts from the assessed best level (assess's metrics.json) in small steps, or, without an
assessment, doubles from 4.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

MIN_STEP = math.log(1.06)
MAX_STEP = math.log(2.0)
NOISE = 0.03  # relative throughput difference read as a real change


@dataclass
class LevelController:
    level: int
    low: int
    high: int
    step: float = MAX_STEP
    direction: int = 1
    min_window_s: float = 2.0
    clock: object = time.monotonic
    history: list = field(default_factory=list)  # (time, level, tokens/s) per measured level
    _previous: tuple[int, float] | None = None  # (level, tokens/s)
    _gains: int = 0
    _changed_at: float = 0.0
    _tokens: int = 0
    _seconds: float = 0.0
    _requests: int = 0
    _in_flight: list = field(default_factory=list)
    _settled: bool = True

    def __post_init__(self):
        self.level = self._clamp(self.level)
        self._changed_at = self.clock()

    @classmethod
    def starting_at(cls, level: int | None, low: int, high: int, **kw) -> LevelController:
        """From the assessed best level (small steps around it), or from 4, doubling until the curve turns."""
        if level:
            return cls(level=level, low=low, high=high, step=math.log(1.25), **kw)
        return cls(level=4, low=low, high=high, **kw)

    def completed(self, tokens: int, latency_s: float) -> None:
        """A request of this server finished; it counts when it was sent at the current level."""
        if self.clock() - latency_s >= self._changed_at:
            self._tokens += tokens
            self._seconds += latency_s
            self._requests += 1

    def tick(self, in_flight: int) -> int | None:
        """Called about once a second with the server's requests in flight: returns the new level when it
        changes."""
        now = self.clock()
        if not self._settled:  # after a step down, the requests above the new level drain first
            if in_flight > self.level:
                return None
            self._settled = True
            self._start_window(now)
        self._in_flight.append(in_flight)
        if self._requests < max(self.level, 4) or now - self._changed_at < self.min_window_s:
            return None
        busy = sum(self._in_flight) / len(self._in_flight)
        if busy < 0.8 * self.level:  # not enough work to fill the level: nothing to learn
            self._start_window(now)
            return None
        rate = busy * self._tokens / max(self._seconds, 1e-9)
        self.history.append((now, self.level, rate))
        new = self._decide(rate)
        self._start_window(now)
        self._settled = False
        return new

    def _decide(self, rate: float) -> int | None:
        previous, self._previous = self._previous, (self.level, rate)
        if previous is not None and previous[0] != self.level:
            gain = rate / max(previous[1], 1e-9) - 1
            if gain > NOISE:
                self._gains += 1
                if self._gains >= 2:
                    self.step = min(MAX_STEP, self.step * 1.5)
            elif gain < -NOISE or self.level > previous[0]:
                self.direction = -1 if self.level > previous[0] else 1
                self.step = max(MIN_STEP, self.step / 2)
                self._gains = 0
        new = self._clamp(round(self.level * math.exp(self.direction * self.step)))
        if new == self.level:
            new = self._clamp(self.level + self.direction)
        if new == self.level:  # at a bound: probe the other way
            self.direction = -self.direction
            new = self._clamp(self.level + self.direction)
        self.level = new
        return new

    def _start_window(self, now: float) -> None:
        self._changed_at, self._tokens, self._seconds, self._requests, self._in_flight = now, 0, 0.0, 0, []

    def _clamp(self, level: int) -> int:
        return max(self.low, min(self.high, int(level)))
