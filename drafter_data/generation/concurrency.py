"""generation.concurrency=auto: each server's level (requests in flight) follows the server's best by itself.

How a level is measured: only requests sent at that level count, and their rate comes from Little's law,
tokens/s = level x (tokens per request) / (seconds per request), over at least 2 x `level` requests (seconds on a
fast server, a few request lifetimes on a slow one). Unlike counting the tokens that happen to finish in a window it
has little noise, and queueing shows in it: requests that wait for a slot take longer, so a level past the server's
capacity measures no better. A step down is measured once the requests above it have drained; when there is not
enough work to fill the level (the end of the input), nothing is decided. Each window also estimates its own noise, the
relative standard error of its rate (long-tailed lengths and a long time to first token make a window of a few dozen
requests read +-3-15%): a neighbour that beats the best by more than NOISE but by less than SIGNIFICANCE standard errors
of the two windows is not taken at once; the next cycle measures it again first, and it is taken when it wins again (a
real slope wins twice, noise seldom does), or at once when it also beats its own last figures by 2 x NOISE plus that
margin (the knee moved up: see below). The first such level waits for its second measurement; another level's win in
between does not replace it. The tests for a change at the best (a drop of 2 x NOISE, a shift of SHIFT) widen by the
same margin. At K2.6's levels (windows of hundreds of requests) the margin is small (about 1% at 200 requests of a
workload with a 1.5 s time to first token); on a simulated server with a knee of 8-64, a 0.3-3 s time to first token and
long-tailed lengths, steady state went from 0.909 to 0.932 of the best fixed level (9 workloads, 10 seeds, two starts).

How the level moves: a pattern search around the best level known, in log steps. A cycle measures the best level again
(so a knee that moves is noticed), then its neighbour one step away in the direction that last paid off, then the other
neighbour. A neighbour that beats the best by more than NOISE (the lower one: that is no worse than it by more than
NOISE/2, since fewer requests in flight for the same tok/s means less queueing) becomes the best, and the step follows
the curve's shape: going up, while tok/s grew about in proportion to the level (elasticity > 0.8: the knee is well
above, or moved up) it climbs on in equal steps of at least CLIMB_STEP (growing ones overshoot a knee near by), growing
by half from the fourth such climb in a row (a knee far above); once it grew much less (< 0.5: the curve bent between
the two, so the knee is there) it halves and looks back between first, in between it is at most CLIMB_STEP; going down
it grows by half (towards 2x), unless tok/s grew in proportion from the nearest level below measured in the last RECENT
windows up to this one: lower levels can then only be worse, and the next probe goes up, halfway to the nearest level
above that measured worse (the one just beaten, or one between) (from nothing: 4, 8, 16 past a knee at 12, then 11 beats
16 and 13 is next, not 9). After a stride, a probe further on that fails is followed by one halfway back, not by the
other side (where the best came from, known worse), and a stride never reaches past halfway to a level further on that
measured worse in the last RECENT windows. When neither neighbour pays, the step halves, down to MIN_STEP, so the level
ends up spending its time at the best and one small step either side of it. Once a cycle at MIN_STEP finds neither
neighbour better, the next UP_ONLY_CYCLES cycles probe only the level above (a knee that moves down shows at the best
itself, one that moves up only above it; at concurrency_max they are the best alone): at a knee of 12 the steady share
of the best goes from 0.96 to 0.97; a best that measures more than 2 x NOISE worse than its last figure ends them, and
the search looks down first (a slower fall is met by the next full cycle). A first neighbour more than SHIFT below the
best (for the lower one: below what its fewer requests would give) sends the search back to the best at once (the server
may have changed), and the next cycle looks at the other side first. When the best level, measured again, is more than
SHIFT off its last figure, the server has changed (a filling KV cache moves the knee down): the step grows back to
SHIFT_STEP, towards where the change points. When it fell, that window may have run partly before the fall and read too
high: a level below that then measures worse than it (but not far worse) is followed by the best again, not by the other
side. A knee that moves up does not show at the best level (below it before and after), only at a level above: one that
beats the best and measures more than 2 x NOISE better than it did in the last RECENT windows means the knee moved up,
and the search strides on up by SHIFT_STEP (the measurements further on are stale), not in CLIMB_STEPs. The search
starts from the assessed best level (assess's metrics.json, for the server it measured) in small steps, downwards first
(a level past the knee is the slow one to measure), or without one from 4 (concurrency_min when higher), doubling. A
window decides on half a level's worth of requests, not 2 x level, once it has run MAX_WINDOW_S or when it measures more
than EARLY_OUT below the best by then.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

MIN_STEP = math.log(1.06)
MAX_STEP = math.log(2.0)
NOISE = 0.03  # relative throughput difference read as a real change
SIGNIFICANCE = 1.2  # a difference within this many standard errors of the two windows' rates must be seen twice
SHIFT, SHIFT_STEP = 0.3, math.log(1.5)  # the best level re-measured this much off: the server changed; step again
CLIMB_STEP = math.log(1.25)  # the least step while tok/s still grows in proportion to the level
EARLY_OUT = 0.5  # a window this far below the best after half its requests is decided then (see tick)
UP_ONLY_CYCLES = 2  # once settled, cycles that probe only the level above before one that probes both sides
RECENT = 6  # windows whose measurements bound a stride (a knee that moves is re-measured within a few)
MAX_WINDOW_S = 15.0  # past this, half a level's worth of requests is enough (a level far past the knee is slow)


@dataclass
class LevelController:
    level: int
    low: int
    high: int
    step: float = MAX_STEP
    direction: int = 1  # the side probed first
    min_window_s: float = 2.0
    clock: object = time.monotonic
    history: list = field(default_factory=list)  # (time, level, tokens/s) per measured level
    best: int = 0
    best_rate: float = 0.0
    _phase: str = "best"  # what the current measurement is: the best again, the first or the second neighbour
    _changed_at: float = 0.0
    _tokens: int = 0
    _seconds: float = 0.0
    _requests: int = 0
    _in_flight: list = field(default_factory=list)
    _settled: bool = True
    _arrived: bool = False  # the best level was just reached from the other side
    _climbs: int = 0  # better levels in a row found going up with tok/s growing in proportion
    _shifted_down: bool = False  # the best's last figure came from the window that found it much slower
    _up_only: int = 0  # settled cycles still to come that probe only the level above the best
    _moments: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # the window's sums of t*t, t*s, s*s per request
    _noise: float = 0.0  # the relative standard error of the last window's rate
    best_noise: float = 0.0  # that of the best level's last window
    _unconfirmed: int = 0  # a level that beat the best within the windows' noise: measured again before it is taken

    def __post_init__(self):
        self.level = self.best = self._clamp(self.level)
        self._changed_at = self.clock()

    @classmethod
    def starting_at(cls, level: int | None, low: int, high: int, **kw) -> LevelController:
        """From the assessed best level (small steps around it), or from 4 (`low` when higher), doubling until the curve
        turns."""
        if level:  # probed downwards first: a level past the knee is the slow one to measure
            return cls(level=level, low=low, high=high, step=math.log(1.25), direction=-1, **kw)
        return cls(level=4, low=low, high=high, **kw)

    def completed(self, tokens: int, latency_s: float) -> None:
        """A request of this server finished; it counts when it was sent at the current level. An answer of no tokens
        (empty, or from a server that sends no usage) counts as one: windows of such answers then compare requests
        served per second, where 0 tok/s at every level would send the search down to `low` (a lower level wins a
        tie). So a decided window (at least 8 requests) never reads 0 tok/s."""
        tokens = max(tokens, 1)
        if self.clock() - latency_s >= self._changed_at:
            self._tokens += tokens
            self._seconds += latency_s
            self._requests += 1
            self._moments[0] += tokens * tokens
            self._moments[1] += tokens * latency_s
            self._moments[2] += latency_s * latency_s

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
        rate = self.level * self._tokens / max(self._seconds, 1e-9)
        enough = max(2 * self.level, 8)
        if now - self._changed_at >= MAX_WINDOW_S or self._far_worse(rate, EARLY_OUT):
            # a level this bad costs more to measure than it can teach. (At SHIFT, the first requests to finish, the
            # short ones, in which the time to first token weighs most, misread good levels as far worse)
            enough = max(self.level // 2, 8)
        if self._requests < enough or now - self._changed_at < self.min_window_s:
            return None
        if min(self._in_flight) < 0.8 * self.level:  # not enough work to fill the level: nothing to learn
            self._start_window(now)
            return None
        self.history.append((now, self.level, rate))
        self._noise = self._window_noise()
        new = self._next_level(rate)
        self._start_window(now)
        self._settled = new >= self.level
        changed = new != self.level
        self.level = new
        return new if changed else None

    def _next_level(self, rate: float) -> int:
        if self._phase == "best":
            self._arrived = False
            if self._up_only:  # a knee that moves down shows here, at the best: then look down first
                dropped = rate < self.best_rate * (1 - 2 * NOISE - self._margin())
                self._up_only, self.direction = (0, -1) if dropped else (self._up_only, 1)
                if self._up_only and self.best >= self.high:  # no level above to probe: the cycle is this window
                    self._up_only -= 1
                    self.best_rate, self.best_noise = rate, self._noise
                    return self.best
            shifted = self.best_rate > 0 and abs(rate / self.best_rate - 1) > SHIFT + self._margin()
            if shifted:
                # the best level itself got much slower (the KV cache filled: the knee moved down) or faster: look
                # far again, first towards where the change points
                self.step = max(self.step, SHIFT_STEP)
                self.direction = 1 if rate > self.best_rate else -1
            self._shifted_down = shifted and rate < self.best_rate
            self.best_rate, self.best_noise = rate, self._noise
            return self._probe("first", self.direction)
        below = self.level < self.best  # as good with fewer in flight is better: less queueing, the same tok/s
        margin = self._margin()
        wins, clearly = self._beats_best(rate, below, 0.0), self._beats_best(rate, below, margin)
        moved_up = not below and self._beats_own_last(rate, margin)  # see _stride
        if wins and (clearly or moved_up or self._unconfirmed == self.level):
            # a better level: move there, stride out the same way (or back, see _stride)
            self.step, self.direction = self._stride(rate, below)
            self.best, self.best_rate, self._arrived, self._up_only = self.level, rate, True, 0
            self.best_noise, self._shifted_down, self._unconfirmed = self._noise, False, 0
            return self._probe("first", self.direction)
        if wins and not self._unconfirmed:  # within the noise of the two windows: measured again next cycle (below)
            self._unconfirmed = self.level
        elif self._unconfirmed == self.level:
            self._unconfirmed = 0
        self._climbs = 0
        if self._phase == "first" and self._up_only and self.level > self.best:
            self._up_only -= 1
            self._phase = "best"
            return self.best
        if self._phase == "first" and self._shifted_down and self.level < self.best and not self._far_worse(rate):
            # that window of the best may have run partly before the change: its figure is too high, and a level
            # below that is better now can measure worse than it. Levels above are only worse when the knee moved
            # down: measure the best again (not the other side by the long step), then look down again
            self._shifted_down = False
            self._phase = "best"
            return self.best
        if self._phase == "first" and not self._far_worse(rate):
            if self._arrived and self.step > MIN_STEP:  # the other side is where the best came from, known worse:
                # look between instead (unless between is where it just looked)
                self.step = max(MIN_STEP, self.step / 2)
                level = self._probe("second", self.direction)
                if level != self.level:
                    return level
            level = self._probe("second", -self.direction)
            if level != self.level:
                return level
            # at a bound both sides are the level just measured: the cycle is over (_phase is now "second")
        # neither side pays: look closer. A first neighbour far worse than the best (more than SHIFT below it, or
        # below what its fewer requests in flight would give: past a knee, or the server changed) is not followed by
        # the other side: the best is measured again now, and the next cycle looks at the other side first
        if self._unconfirmed:  # the next cycle measures the level that won within the noise again, first
            self.direction, self._up_only = (1 if self._unconfirmed > self.best else -1), 0
            self.step = abs(math.log(self._unconfirmed / self.best))
            self._phase = "best"
            return self.best
        if self._phase == "first":
            self.direction, self._up_only = -self.direction, 0
        elif self.step <= MIN_STEP:  # settled: see UP_ONLY_CYCLES
            self._up_only = UP_ONLY_CYCLES
        self.step = max(MIN_STEP, self.step / 2)
        self._phase = "best"
        return self.best

    def _stride(self, rate: float, below: bool) -> tuple[float, int]:
        """The next step and side after a better level: longer while tok/s still grows about in proportion to the
        level (the flat part of a request's time: far from the knee), shorter and back first once it grows much
        less (the curve bent between the two: the knee is there, and a level past it is slow to measure). It never
        reaches past halfway to a level further on that measured worse in the last RECENT windows, unless this level
        itself measured much worse in them: then the knee moved up, and strides out by SHIFT_STEP."""
        step, climbs, direction = min(MAX_STEP, self.step * 1.5), 0, -1 if below else 1
        if not below and self.level > self.best:
            elasticity = math.log(rate / self.best_rate) / math.log(self.level / self.best)
            if elasticity < 0.5:
                step, direction = self.step / 2, -1
            elif elasticity > 0.8:  # tok/s grew with the level: the knee is well above (or moved up). Climb on
                # in equal steps (a growing one overshoots a knee near by, and a level past it is slow to measure),
                # growing by half from the fourth such climb in a row (a knee far above)
                step = max(self.step * (1.5 if self._climbs > 2 else 1.0), CLIMB_STEP)
                climbs = self._climbs + 1
            else:
                step = min(self.step, CLIMB_STEP)
        elif below:
            lower = [(lv, r) for _, lv, r in reversed(self.history[-RECENT:-1]) if lv < self.level]
            if lower:
                lower_level, lower_rate = max(lower, key=lambda m: m[0])  # the nearest below, its latest measurement
                if (math.log(rate) - math.log(lower_rate)) / math.log(self.level / lower_level) > 0.8:
                    # tok/s still grows in proportion up to this level: lower ones can only be worse, and the knee
                    # lies between this level and the nearest above that measured worse (the one just beaten, or one
                    # between): look halfway there (when that is the next level, it is measured again: in
                    # simulations that beat striding down)
                    worse_above = [lv for _, lv, r in self.history[-RECENT:] if self.level < lv and r < rate]
                    above = min([self.best, *worse_above])
                    self._climbs = 0
                    return max(MIN_STEP, math.log(above / self.level) / 2), 1
        self._climbs = climbs
        if not below and self._beats_own_last(rate) and self.level < self.high:
            # the knee moved up: the best level does not show it (below the knee, before and after), only a level
            # above it; the measurements further on are stale. (At the upper bound there is nowhere to stride to:
            # the search goes on as usual, not to the other side by the long step)
            return max(step, SHIFT_STEP), 1
        further = [lv for _, lv, r in self.history[-RECENT:] if r < rate and (lv < self.level if below
                                                                              else lv > self.level)]
        if further:
            nearest = max(further) if below else min(further)
            step = min(step, abs(math.log(nearest / self.level)) / 2)
        return max(MIN_STEP, min(MAX_STEP, step)), direction

    def _beats_best(self, rate: float, below: bool, margin: float) -> bool:
        """Better than the best by NOISE plus `margin`; a lower level: no worse than it by more than NOISE/2, less
        `margin` (the same tok/s with fewer requests in flight is better: less queueing)."""
        if below:
            return rate >= self.best_rate * (1 - NOISE / 2 + margin)
        return rate > self.best_rate * (1 + NOISE + margin)

    def _beats_own_last(self, rate: float, margin: float = 0.0) -> bool:
        """This level measures more than 2 x NOISE plus `margin` better than it did in the last RECENT windows."""
        before = [r for _, lv, r in self.history[-RECENT:-1] if lv == self.level]
        return bool(before) and rate > max(before) * (1 + 2 * NOISE + margin)

    def _window_noise(self) -> float:
        """The relative standard error of the window's rate (a ratio estimator, tokens / seconds over its requests):
        near 0 when every request ran at the same tokens/s, large for a few requests of mixed lengths with a long time
        to first token."""
        n, tokens, seconds = self._requests, self._tokens, self._seconds
        if n < 2 or seconds <= 0:
            return 0.0
        ratio = tokens / seconds
        tt, ts, ss = self._moments
        spread = max(0.0, (tt - 2 * ratio * ts + ratio * ratio * ss) / (n - 1))  # of tokens - ratio x seconds
        return math.sqrt(spread * n) / tokens

    def _margin(self) -> float:
        """What the two windows' noise adds to NOISE: a difference inside it is seen twice before it counts."""
        return max(0.0, SIGNIFICANCE * math.hypot(self._noise, self.best_noise) - NOISE)

    def _far_worse(self, rate: float, by: float = SHIFT) -> bool:
        """More than `by` below the best, or for a lower level below what its fewer requests in flight would give."""
        return rate < self.best_rate * (1 - by) * min(1.0, self.level / self.best)

    def _probe(self, phase: str, direction: int) -> int:
        """The neighbour of the best one step towards `direction` (at a bound: the other side)."""
        for side in (direction, -direction):
            level = self._clamp(round(self.best * math.exp(side * self.step)))
            if level == self.best:
                level = self._clamp(self.best + side)
            if level != self.best:
                self._phase = phase
                return level
        self._phase = "best"
        return self.best

    def _start_window(self, now: float) -> None:
        self._changed_at, self._tokens, self._seconds, self._requests, self._in_flight = now, 0, 0.0, 0, []
        self._moments = [0.0, 0.0, 0.0]

    def _clamp(self, level: int) -> int:
        return max(self.low, min(self.high, int(level)))
