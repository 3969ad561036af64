"""generation.concurrency=auto: each server's level (requests in flight) follows its best by a bracketing search.

A window measures one level by the tokens that arrive while it holds (streamed: each chunk as it comes; unstreamed:
an answer's tokens when it ends), once it has settled: after a step down the requests above it have finished (or
been withdrawn: server/pool.py), then the first tokens of its new requests have had time to come (1 s + SETTLE x the
usual wait for them). It lasts WINDOW_S, streamed at least that wait (unstreamed: until max(ANSWERS, level)
answers have ended), up to STRETCH x longer when windows of the best spread by over SPREAD; one FAR worse than the
best, or better going up, is decided unstretched. Its standard error comes from its per-second rates.
The search, on a log scale, over the levels measured since the server last changed:
  1. expand: while the best has no measured level above (or below) it, probe one stride further: x2 from nothing,
     x1.25 on a re-probe, the stride doubling while probes win (to x1.56 at most on a re-probe). From an assessed
     level, down first;
  2. narrow: with a worse level on both sides, probe the geometric middle of the wider gap; a winner is the best,
     a loser the new bound on its side;
  3. hold: once both gaps are under CLOSE, stay at the best HOLD windows; after a re-probe that found nothing and
     cost c (the busy seconds of the best's rate it fell short by, withdrawn tokens included), c / BUDGET seconds
     (HOLD_MAX_S at most); then re-probe: forget the other levels, expand from the best again, upwards first.
The best has the highest rate / level ** TIE (a lower level wins a tie: less queueing). A neighbour within Z standard
errors of the best (at least the spread between the best's windows) is measured again, up to POOL windows each (they
pool). A window at the best more than SHIFT (and Z errors) off its rate is measured again; off twice the same way,
the server changed: all else is forgotten and the search expands from the best towards the change, by as much as the
rate moved (x1.25 to x2). A window that could not keep its level busy (the end of the input) is dropped.
Why this and not a gradient (Vegas) limiter or AIMD, and how it fares on a grid of simulated servers
(bench/concurrency_grid.py): docs/design/concurrency.md.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

TIE = 0.02  # the preference for fewer requests in flight: rate / level ** TIE
Z = 2.0  # a difference within Z standard errors of the two levels' pooled rates is measured again
POOL = 3  # windows of one level pooled (and the most a level is measured while it is in doubt)
CLOSE = math.log(1.12)  # gaps below this (or between adjacent levels) end the narrowing
HOLD = 5  # windows at the best between re-probes, at least
BUDGET = 0.02  # the most of the best's rate re-probes cost: one that cost c seconds of it is followed by c / BUDGET
HOLD_MAX_S = 600.0  # ... but no longer (a stalled server costs a re-probe without end; a knee may move up)
SHIFT = 0.15  # the best re-measured this far off its pooled rate: the server changed
FAR = 0.3  # a window this far below the best is decided at WINDOW_S
WINDOW_S = 2.0  # a window's seconds (streamed, at least the usual first-token wait), up to STRETCH x longer when the
# best's windows spread over SPREAD
SPREAD, STRETCH = 0.05, 8.0
ANSWERS = 4  # an unstreamed window's fewest answers (and a level's worth)
SETTLE = 1.0  # a window starts 1 s plus this many first-token waits after its level is set
BACK_AFTER = 3  # windows away from the best after which it is measured again (its figure is getting old)


@dataclass
class Window:
    tokens: float = 0.0
    seconds: float = 0.0
    n: int = 0  # seconds measured (ticks), with the sums of their rates and squared rates for the standard error
    r: float = 0.0
    rr: float = 0.0
    busy: float = 0.0  # the sum over the ticks of the requests in flight
    answers: int = 0  # unstreamed answers ended, and their tokens (counted when they end)
    late: float = 0.0

    def add(self, tokens: float, seconds: float, in_flight: int, answers: int = 0, late: float = 0.0) -> None:
        rate = tokens / max(seconds, 1e-9)
        self.tokens, self.seconds, self.n = self.tokens + tokens, self.seconds + seconds, self.n + 1
        self.r, self.rr, self.busy = self.r + rate, self.rr + rate * rate, self.busy + in_flight
        self.answers, self.late = self.answers + answers, self.late + late

    def unstreamed(self) -> bool:
        """Most of its tokens came whole at their answers' end: a few seconds of them say little."""
        return self.late > self.tokens / 2

    def merged(self, other: Window) -> Window:
        return Window(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    def rate(self) -> float:
        return max(self.tokens, 1e-9) / max(self.seconds, 1e-9)

    def noise(self) -> float:
        """The relative standard error of the rate, from its per-second rates."""
        if self.n < 2 or self.r <= 0:
            return 0.0
        mean = self.r / self.n
        spread = max(0.0, (self.rr - self.n * mean * mean) / (self.n - 1))
        return math.sqrt(spread / self.n) / mean


@dataclass
class LevelController:
    level: int
    low: int
    high: int
    stride: float = 2.0
    direction: int = 1  # the side expanded first when both are open
    clock: object = time.monotonic
    history: list = field(default_factory=list)  # (time, level, tokens/s) per decided window
    streams: bool = False  # a streamed chunk has come (else answers come whole, their tokens at their end)
    measured: dict = field(default_factory=dict)  # level -> its windows since the server last changed
    best: int = 0
    _held: int = 0
    _suspect: int = 0  # the best's last window was far off its rate, up (1) or down (-1): measured again
    _suspect_window: Window | None = None
    _spread2: float = 0.0  # the mean square of log(window / pooled rate) at the best: the noise between windows
    _cap: float = 2.0  # the longest stride: x1.56 on a re-probe (near a knee that may have moved, not far off it)
    _since_best: int = 0  # windows since the last at the best
    _probe_rate: float | None = None  # the best's rate as the re-probe under way left it
    _lost_s: float = 0.0  # ... and the seconds of that rate it has fallen short by so far
    _hold_until: float = 0.0
    _window: Window = field(default_factory=Window)
    _started: float = 0.0
    _last_tick: float = 0.0
    _arrived: float = 0.0  # tokens since the last tick
    _ended: int = 0  # unstreamed answers since the last tick, and their tokens
    _late: float = 0.0
    _answered: bool = False  # an answer has ended (its first-token wait then counts instead of the first chunks')
    _first_s: float | None = None  # the usual wait for a request's first token (unstreamed: for its answer)
    _settled: bool = True

    def __post_init__(self):
        self.level = self.best = self._clamp(self.level)
        self._started = self._last_tick = self.clock()

    @classmethod
    def starting_at(cls, level: int | None, low: int, high: int, **kw) -> LevelController:
        """From the assessed best level, halving first (a level past the knee is the slow one to measure), or from 4
        (`low` when higher), doubling."""
        if level:
            return cls(level=level, low=low, high=high, direction=-1, **kw)
        return cls(level=4, low=low, high=high, **kw)

    @property
    def best_rate(self) -> float:
        return self._rate(self.best) if self.best in self.measured else 0.0

    def arrived(self, tokens: float = 1, first_s: float | None = None) -> None:
        """Tokens of an answer arrived (a streamed chunk); its first, `first_s` after its request was sent: until an
        answer ends, these tell how long a window waits (then the ended answers' waits do)."""
        self._arrived += tokens
        if first_s is not None:
            self.streams = True
            if not self._answered:
                self._first_s = first_s if self._first_s is None else 0.8 * self._first_s + 0.2 * first_s

    def completed(self, tokens: int, latency_s: float, first_s: float | None = None) -> None:
        """An answer ended, `latency_s` after it was sent, its first tokens streamed `first_s` after (None: it came
        whole, its tokens arrive now; an empty answer, or a server that sends no usage, counts one: windows then
        compare answers per second)."""
        wait = latency_s if first_s is None else first_s
        self._first_s = wait if self._first_s is None else 0.8 * self._first_s + 0.2 * wait
        self._answered = True
        if first_s is None:
            self._arrived += max(tokens, 1)
            self._late += max(tokens, 1)
            self._ended += 1

    def withdrawn(self, tokens: float) -> None:
        """A request withdrawn by a step down had streamed `tokens`: lost, they count against the re-probe."""
        if self._probe_rate:
            self._lost_s += tokens / self._probe_rate

    def tick(self, in_flight: int) -> int | None:
        """Called about once a second with the server's requests in flight: the new level when it changes."""
        now = self.clock()
        tokens, seconds, self._arrived, self._last_tick = self._arrived, now - self._last_tick, 0.0, now
        stopped = seconds > 60.0  # no tick for a minute (the process was stopped): what came in between is no rate
        if self._probe_rate and 0 < seconds and not stopped and in_flight >= 0.8 * self.level:  # busy, not a pause
            self._lost_s += seconds - tokens / self._probe_rate
        ended, late, self._ended, self._late = self._ended, self._late, 0, 0.0
        if not self._settled:  # after a step down, the requests above the new level finish first
            if in_flight > self.level:
                return None
            self._settled = True
            self._start(now)
        if stopped:
            self._start(now)
        if self._first_s is None or now - self._started < 1.0 + SETTLE * self._first_s or seconds <= 0:
            return None  # the new level's first tokens are still on their way (or no first tokens yet)
        w, level = self._window, self.level
        w.add(tokens, seconds, in_flight, ended, late)
        stretch = self._stretch()
        # streamed, a window shorter than the first-token wait could fall while requests sent together all wait
        shortest = max(WINDOW_S, self._first_s) if self.streams else WINDOW_S
        needed = shortest * stretch
        if self.best != level and self.best in self.measured and w.seconds >= shortest:
            ratio = self._score(w.rate(), level) / self._score(self.best_rate, self.best)
            if ratio < 1 - FAR or ratio > 1 + FAR and level > self.best:
                needed = shortest  # far worse (more would only cost) or far better
        if w.seconds < needed or (not self.streams or w.unstreamed()) and w.answers < max(ANSWERS, level):
            return None  # unstreamed: a few seconds of whole answers say little
        if w.busy < 0.8 * level * w.n:  # too little work to fill the level: nothing learnt
            self._start(now)
            return None
        self.history.append((now, level, w.rate()))
        new = self._decide(level, w)
        self._start(now)
        self._settled = new >= level
        self.level = new
        return new if new != level else None

    # --- the search -------------------------------------------------------------------------------------------

    def _decide(self, level: int, w: Window) -> int:
        if level == self.best and self.best in self.measured:
            self._since_best = 0
            changed = self._changed(w)
            if changed and self._suspect == changed:
                # off twice the same way: the server changed. Forget the rest, expand again from the best, first
                # towards where the change points, by as much as the rate moved (x1.25 to x2)
                fell = abs(math.log(w.rate() / self.best_rate))
                self.direction, self.stride, self._cap = changed, min(2.0, max(1.25, math.exp(fell))), 2.0
                self._forget(lambda lv: True)
                self.measured = {level: [self._suspect_window, w]}
                self._held, self._suspect, self._probe_rate, self._hold_until = 0, 0, None, 0.0
                return self._next()
            if changed:  # once could be noise: measure the best again
                self._suspect, self._suspect_window = changed, w
                return level
            if self._suspect:
                self.measured[level].append(self._suspect_window)
            self._suspect = 0
            gap = math.log(w.rate() / self.best_rate)
            self._spread2 = 0.7 * self._spread2 + 0.3 * gap * gap
        self.measured.setdefault(level, []).append(w)
        self.measured[level] = self.measured[level][-POOL:]
        old = self.best
        self.best = max(self.measured, key=lambda lv: self._standing(lv, old))
        if self.best != old:
            self._rebase(old, self.best)
            self._held, self._probe_rate, self._hold_until, d = 0, None, 0.0, 1 if self.best > old else -1
            if not any((lv - self.best) * d > 0 for lv in self.measured):  # won outwards: stride on, longer
                self.stride, self.direction = min(self._cap, self.stride ** 2), d
        elif level == self.best:
            self._held += 1
        self._since_best = 0 if level == self.best else self._since_best + 1
        return self._next()

    def _next(self) -> int:
        best = self.best
        below = [lv for lv in self.measured if lv < best]
        above = [lv for lv in self.measured if lv > best]
        lo, hi = (max(below) if below else None), (min(above) if above else None)
        if self._since_best >= self.back_after:  # the best's figure is getting old (the server may have changed)
            return best
        open_sides = [d for d, bound, edge in ((1, hi, self.high), (-1, lo, self.low))
                      if bound is None and best != edge]
        if open_sides:
            d = self.direction if self.direction in open_sides else open_sides[0]
            return self._clamp_away(round(best * self.stride ** d), d)
        for side in (lo, hi):  # a neighbour within the noise: measure again
            again = self._again(side) if side is not None and self._in_doubt(side) else None
            if again is not None:
                return again
        gaps = [(math.log(b / best) * d, d, b) for d, b in ((1, hi), (-1, lo)) if b is not None and abs(b - best) > 1]
        gaps = [g for g in gaps if g[0] > CLOSE]
        if gaps:
            _, d, bound = max(gaps)
            return self._clamp_away(round(math.sqrt(best * bound)), d)
        now = self.clock()
        if self._probe_rate and self._held and not self._since_best:  # a window at the best closed the re-probe
            self._hold_until, self._probe_rate = now + min(HOLD_MAX_S, max(0.0, self._lost_s) / BUDGET), None
        if self._held < HOLD or now < self._hold_until:
            return best
        self._probe_rate, self._lost_s = self.best_rate, 0.0
        # re-probe: forget the levels above, expand again from the best by the small stride (a knee that moves up
        # shows only above the best; one that moves down, at the best itself)
        self._forget(lambda lv: lv > best)
        self.stride, self._cap, self.direction, self._held = 1.25, 1.25 ** 2, 1, 0
        return self._next() if best < self.high else best

    def _noise(self, level: int, w: Window | None = None) -> float:
        """A rate's relative standard error: from its per-second rates, at least the spread between the best's
        windows."""
        windows = [w] if w else self.measured[level]
        within = w.noise() if w else self._pooled(level).noise()
        return max(within, math.sqrt(self._spread2 / len(windows)))

    # --- what a variant of the search may change (bench/concurrency_alternatives.py) ---------------------------

    back_after = BACK_AFTER

    def _stretch(self) -> float:
        """How much longer than the shortest a window lasts: by as much as the best's windows spread over SPREAD."""
        return min(STRETCH, max(1.0, self._spread2 / SPREAD ** 2)) if self.measured else 1.0

    def _standing(self, level: int, old: int) -> float:
        """The best is the level where this is highest (`old`: the best so far): its score."""
        return self._score(self._rate(level), level)

    def _rebase(self, old: int, new: int) -> None:
        """The best has moved from `old` to `new`."""

    def _forget(self, drop) -> None:
        """The levels for which drop(level) holds are measured no more (the server changed; a re-probe)."""
        self.measured = {lv: ws for lv, ws in self.measured.items() if not drop(lv)}

    def _again(self, side: int) -> int | None:
        """A neighbour in doubt: the level measured again, the one with fewer windows first (None: both have POOL)."""
        pick = self.best if len(self.measured[self.best]) < len(self.measured[side]) else side
        return pick if len(self.measured[pick]) < POOL else None

    def _gap(self, level: int) -> float:
        """log(level's score / the best's)."""
        return math.log(self._score(self._rate(level), level) / self._score(self.best_rate, self.best))

    def _in_doubt(self, level: int) -> bool:
        return abs(self._gap(level)) < Z * math.hypot(self._noise(level), self._noise(self.best))

    def _changed(self, w: Window) -> int:
        """+1 or -1: the best's new window is that far off its pooled rate (0: it is not)."""
        gap = math.log(w.rate() / self.best_rate)
        off = abs(gap) > max(SHIFT, Z * math.hypot(self._noise(self.best, w), self._noise(self.best)))
        return (1 if gap > 0 else -1) if off else 0

    def _pooled(self, level: int) -> Window:
        total = Window()
        for w in self.measured[level]:
            total = total.merged(w)
        return total

    def _rate(self, level: int) -> float:
        return self._pooled(level).rate()

    @staticmethod
    def _score(rate: float, level: int) -> float:
        return max(rate, 1e-9) / level ** TIE

    def _clamp_away(self, level: int, direction: int) -> int:
        """`level` within the bounds, at least one away from the best towards `direction`."""
        if direction > 0:
            level = max(level, self.best + 1)
        else:
            level = min(level, self.best - 1)
        return self._clamp(level)

    def _start(self, now: float) -> None:
        self._started, self._window = now, Window()

    def _clamp(self, level: int) -> int:
        return max(self.low, min(self.high, int(level)))
