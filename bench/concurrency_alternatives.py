"""The controllers concurrency=auto was chosen against, with LevelController's interface (level, started, arrived,
completed, tick, history) and answered(tokens, latency), for bench/concurrency_grid.py --controller
gradient|aimd|bandit|paired|hybrid. The first two are latency-based, as published; the latency of an LLM request
grows with its length, so both read seconds per output token.

- GradientLimiter: Netflix concurrency-limits' Gradient2 (a TCP Vegas-like gradient): every second,
  gradient = clamp(TOLERANCE x long-term latency / short-term latency, 0.5, 1), new = level x gradient + sqrt(level),
  smoothed by 0.2.
- AimdLimiter: additive increase while latency is within 1.5x of the least seen (x1.1 + 1 per second of answers),
  multiplicative decrease (x0.8) past it.
- BanditController: auto's expansion (x2 until a probe loses) and change detection, then instead of narrowing
  and holding a unimodal bandit (OSUB, Combes & Proutiere 2014, as used for 802.11 rate adaptation): the leader (the
  best discounted mean of log(rate) - TIE x log(level)) is played every LEAD_EVERY-th time it leads, else the highest
  upper confidence bound among it and its neighbours x 2^(+-1/4); every window discounts all levels' statistics by
  GAMMA (discounted UCB, Garivier & Moulines 2011) so that a server that changes is followed; a neighbour that wins
  expands again that way from x1.25 (steps of 2^(1/4) alone climbed from 5 to a knee of 256 too slowly to matter).
  Its windows use the pooled spread of log(rate), PRIOR_SD until levels are measured, so they start 4x auto's.
- PairedController: auto's search with each probe judged against the best's windows next to it in time (below);
  HybridController pairs them only while the first-token wait is under WINDOW_S, and is auto's search past it. Both
  keep two faults a review found (a probe with no pair re-measured without end; a new best's lucky ratio chained into
  the others'): fixed on branch wip/hybrid-pairing, where it then ties with auto's (docs/design/concurrency.md).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from drafter_data.generation.concurrency import POOL, SHIFT, TIE, WINDOW_S, Z, LevelController, Window


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


GAMMA = 0.95  # each decided window discounts every level's statistics (a server that changes is followed)
LEAD_EVERY = 3  # the leader is played every 3rd time it leads, else the best upper bound of it and its neighbours
STEP = 2 ** 0.25  # the neighbours of a level: x 2^(-1/4) and x 2^(1/4)
PRIOR_SD, PRIOR_N = 0.1, 2.0


@dataclass
class _Stats:
    n: float = 0.0
    s: float = 0.0
    ss: float = 0.0

    def mean(self) -> float:
        return self.s / self.n


@dataclass
class BanditController(LevelController):
    stats: dict = field(default_factory=dict)
    _led: int = 0
    _expanding: bool = True
    _flipped: bool = False
    _middle_done: bool = False
    _suspect_x: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        self._flipped = self.direction > 0  # from nothing, up only; from an assessed level, down then up once

    @property
    def best_rate(self) -> float:
        st = self.stats.get(self.best)
        return math.exp(st.mean() + TIE * math.log(self.best)) if st and st.n > 0 else 0.0

    def _x(self, w: Window, level: int) -> float:
        return math.log(max(w.rate(), 1e-9)) - TIE * math.log(level)

    def _sigma(self) -> float:
        dev, dof = PRIOR_SD ** 2 * PRIOR_N, PRIOR_N
        for st in self.stats.values():
            if st.n > 1:
                dev += max(0.0, st.ss - st.s * st.s / st.n)
                dof += st.n - 1
        return math.sqrt(dev / dof)

    def _add(self, level: int, x: float) -> None:
        for st in self.stats.values():
            st.n, st.s, st.ss = st.n * GAMMA, st.s * GAMMA, st.ss * GAMMA
        st = self.stats.setdefault(level, _Stats())
        st.n, st.s, st.ss = st.n + 1, st.s + x, st.ss + x * x
        self.measured[level] = [None]  # for the base class: the level has been measured

    def _leader(self) -> int:
        return max(self.stats, key=lambda lv: self.stats[lv].mean())

    def _decide(self, level: int, w: Window) -> int:
        x = self._x(w, level)
        sigma = self._sigma()
        if level == self.best and self.best in self.stats and not self._expanding:
            st = self.stats[level]
            gap = x - st.mean()
            off = abs(gap) > max(SHIFT, Z * sigma * math.sqrt(1 + 1 / st.n))
            changed = (1 if gap > 0 else -1) if off else 0
            if changed and self._suspect == changed:
                prev = self._suspect_x
                self.stats = {level: _Stats(2.0, prev + x, prev * prev + x * x)}
                self.measured = {level: [None]}
                self._suspect = 0
                self._expanding, self._flipped, self._middle_done = True, True, False
                self.direction, self.stride = changed, min(2.0, max(1.25, math.exp(abs(gap))))
                return self._probe(level)
            if changed:
                self._suspect, self._suspect_x = changed, x
                return level
            if self._suspect:
                self._add(level, self._suspect_x)
            self._suspect = 0
        old_best = self.best
        self._add(level, x)
        self._spread2 = sigma ** 2
        if self._expanding:
            if level == old_best and old_best == self._leader():
                return self._probe(level)  # the start: first probe
            if self._leader() == level and level != old_best:  # the probe won: on, further
                self.best, self.stride = level, min(2.0, self.stride ** 2)
                return self._probe(level)
            # the probe lost
            if not self._flipped and len(self.stats) == 2:
                self._flipped, self.direction = True, -self.direction
                return self._probe(self.best)
            self._expanding = False
            far = abs(math.log(level / self.best)) > 1.5 * math.log(STEP)
            if far and not self._middle_done:
                self._middle_done = True
                return self._clamp(round(math.sqrt(level * self.best)))
        return self._bandit()

    def _probe(self, frm: int) -> int:
        new = self._clamp(round(frm * self.stride ** self.direction))
        if new == frm:
            new = self._clamp(frm + self.direction)
        if new == frm:  # at the edge
            self._expanding = False
            return self._bandit()
        return new

    def _bandit(self) -> int:
        leader = self._leader()
        if leader != self.best:
            self._led = 0
            if leader == self.level:
                # a neighbour won: expand again that way, from x1.25 (a premature stop, or a knee that moved)
                self.best, self.direction, self.stride = leader, 1 if leader > self.best else -1, 1.25
                self._expanding, self._flipped, self._middle_done = True, True, False
                return self._probe(leader)
        self.best = leader
        self._led += 1
        if self._led % LEAD_EVERY == 1:
            return leader
        up = self._clamp(max(leader + 1, round(leader * STEP)))
        down = self._clamp(min(leader - 1, round(leader / STEP)))
        total = sum(st.n for st in self.stats.values())
        sigma = self._sigma()

        def index(lv):
            st = self.stats.get(lv)
            if not st or st.n < 1e-3:
                return math.inf
            return st.mean() + sigma * math.sqrt(2 * math.log(max(total, 1.0)) / st.n)

        return max({leader, up, down}, key=lambda lv: (index(lv), lv == leader))


@dataclass
class PairedController(LevelController):
    """Auto's search, but back to the best after every probe, and a probe judged by its window's log ratio to the best's
    windows on either side of it (A-B-A; one side until the best's next window), not by the two levels' pooled rates:
    a server's slow changes (drift, the mix of answers under way) cancel between windows next to each other. A
    neighbour in doubt is measured again while the mean of its ratios is within Z x sqrt(noise / n), the noise being
    the mean square of log(the best's window / the best's window before it). Windows are not stretched."""

    diffs: dict = field(default_factory=dict)  # level -> log(its window / the best's window next to it), per window
    _last: tuple | None = None  # (level, window, when decided) of the window decided last
    _open: int | None = None  # the probe whose ratio waits for the best's next window (its other side)
    _pair2: float = 0.0  # the mean square of log(the best's window / the best's window just before it)

    back_after = 1  # back to the best after every probe: its next window is the probe's other side

    def _decide(self, level: int, w: Window) -> int:
        now = self.clock()
        last, self._last = self._last, (level, w, now)
        if last and self._started - last[2] > 1.5:  # a window was dropped or the process stopped in between
            last = None
        adjacent = last is not None and last[0] == self.best and self.best in self.measured
        if level == self.best and last is not None and last[0] != level and self._open == last[0] \
                and last[0] in self.diffs:  # the probe's other side: A-B-A
            d = self.diffs[last[0]]
            d[-1] = (d[-1] + math.log(last[1].rate() / w.rate())) / 2
        self._open = None
        if level == self.best and adjacent:
            gap = math.log(w.rate() / last[1].rate())
            self._pair2 = gap * gap if not self._pair2 else 0.7 * self._pair2 + 0.3 * gap * gap
        if level != self.best and adjacent:
            self.diffs[level] = (self.diffs.get(level, []) + [math.log(w.rate() / last[1].rate())])[-POOL:]
            self._open = level
        return super()._decide(level, w)

    def _stretch(self) -> float:
        return 1.0

    def _standing(self, level: int, old: int) -> float:
        return self._gap(level) if level != old else 0.0

    def _rebase(self, old: int, new: int) -> None:
        """The ratios, to the new best: each less the new best's own mean ratio to the old."""
        if new not in self.diffs:
            self.diffs = {}
            return
        g = sum(self.diffs[new]) / len(self.diffs[new])
        self.diffs = {lv: [x - g for x in d] for lv, d in self.diffs.items() if lv != new}
        self.diffs[old] = [-g]

    def _forget(self, drop) -> None:
        super()._forget(drop)
        self.diffs = {lv: d for lv, d in self.diffs.items() if not drop(lv)}

    def _again(self, side: int) -> int | None:
        return side if len(self.diffs.get(side, self.measured[side])) < POOL else None

    def _gap(self, level: int) -> float:
        """log(level's score / the best's): from its ratios to the best's windows next to it where it has them."""
        tie = -TIE * math.log(level / self.best)
        if level in self.diffs:
            return sum(self.diffs[level]) / len(self.diffs[level]) + tie
        return math.log(self._rate(level) / self.best_rate) + tie

    def _in_doubt(self, level: int) -> bool:
        if level not in self.diffs:
            return super()._in_doubt(level)
        within = self.measured[level][-1].noise() ** 2 + self.measured[self.best][-1].noise() ** 2
        return abs(self._gap(level)) < Z * math.sqrt(max(self._pair2, within) / len(self.diffs[level]))


@dataclass
class HybridController(PairedController):
    """PairedController while the usual first-token wait is under WINDOW_S; past it, auto's search as it stands:
    requests sent together then wait together, and windows next to each other are bound to that phase rather than
    cancelling the server's slow changes (point 5 of the grid, 3-s first tokens, was paired's worst)."""

    def _pairs(self) -> bool:
        return self._first_s is not None and self._first_s < WINDOW_S

    @property
    def back_after(self) -> int:
        return PairedController.back_after if self._pairs() else LevelController.back_after

    def _stretch(self) -> float:
        return super()._stretch() if self._pairs() else LevelController._stretch(self)

    def _standing(self, level: int, old: int) -> float:
        return super()._standing(level, old) if self._pairs() else LevelController._standing(self, level, old)

    def _again(self, side: int) -> int | None:
        return super()._again(side) if self._pairs() else LevelController._again(self, side)

    def _gap(self, level: int) -> float:
        return super()._gap(level) if self._pairs() else LevelController._gap(self, level)

    def _in_doubt(self, level: int) -> bool:
        return super()._in_doubt(level) if self._pairs() else LevelController._in_doubt(self, level)
