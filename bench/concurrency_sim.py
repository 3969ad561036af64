"""Simulated continuous-batching servers for generation.concurrency=auto, in simulated time (a 2-hour run in a
second): the controller of drafter_data/generation/concurrency.py, or a fixed level, against one engine.

The engine: `slots` sequences run at once, the rest queue (FIFO). A sequence admitted to a slot first prefills for
its time to first token, then decodes one token per engine step; a step takes
    token_s x (1 + (active - 1) / bend) x max(1, active / knee) ** power
with `active` the decoding sequences: `bend` gives diminishing returns from the start (real engines' decode batching),
`power` the knee's sharpness (plateau: 0 with slots = knee, requests past it only queue; gentle: 1.2, tok/s falls
slowly past the knee; steep: 2, as (active / 24) ** 2). Answers are long-tailed (lognormal, 50 to 4,000 tokens),
each sequence runs at its own speed (off by `noise`), and the whole engine drifts slowly (a random walk of `noise` / 2
over ~10 s). The knee can move mid-run (`move_at`, `moved_knee`). The client keeps `level` requests in flight, as
generate's workers do: a lower level withdraws the youngest requests sent at the level before it (their tokens so far
are lost; streamed only, as the stage does), the older ones finish first.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

SHARPNESS = {"plateau": 0.0, "gentle": 1.2, "steep": 2.0}


@dataclass(frozen=True)
class Engine:
    knee: int
    sharpness: str = "steep"
    bend: float = 1e9  # active sequences at which a step is twice as long as alone (diminishing returns)
    token_s: float = 0.02
    ttft_s: float = 0.0
    median_tokens: int = 300
    sigma: float = 0.8
    min_tokens: int = 50
    max_tokens: int = 4000
    noise: float = 0.05
    drift: bool = True  # the whole engine's slow random walk (False: only each sequence's own speed varies)
    slots: int = 0  # 0: plateau -> knee, else 4 x knee
    move_at: float | None = None  # share of the run
    moved_knee: int | None = None
    name: str = ""

    @property
    def n_slots(self) -> int:
        return self.slots or (self.knee if self.sharpness == "plateau" else max(64, 4 * self.knee))

    def step_s(self, active: int, knee: int) -> float:
        power = SHARPNESS[self.sharpness]
        return self.token_s * (1 + max(active - 1, 0) / self.bend) * max(1.0, active / knee) ** power

    def ideal(self, level: int, knee: int | None = None) -> float:
        """Steady tok/s at `level` in flight with every request decoding (no prefill): a rough guide only."""
        knee = knee or self.knee
        active = min(level, self.n_slots)
        return active / self.step_s(active, knee)

    def latency_at(self, level: int) -> float:
        """A typical request's seconds at `level` (mean length), for the run's time scale."""
        mean = self.median_tokens * math.exp(self.sigma ** 2 / 2)
        active = min(max(level, 1), self.n_slots)
        return (self.ttft_s + mean * self.step_s(active, self.knee)) * max(1.0, level / self.n_slots)


@dataclass
class Result:
    whole: float  # tok/s over the run
    steady: float  # tok/s over the steady part (the run's second half)
    series: list = field(default_factory=list)  # (s, level, tok/s) every `every` s


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulate(engine: Engine, level_or_controller, duration_s: float, seed: int, steady_from: float = 0.5,
             every_s: float | None = None, steps: int = 12000, streamed: bool = True,
             common_luck: bool = False) -> Result:
    """The engine for `duration_s` simulated seconds at a fixed level (an int) or under a controller made by
    `level_or_controller(clock)` (a callable taking the Clock). The controller is told of each first token and of
    the tokens as they come (streamed), and of a withdrawn request's tokens so far (lost), or (`streamed=False`, as
    with generate.stream=false) of each answer's tokens when it ends. `common_luck`: runs of one seed share their
    luck whatever the level, as on one server with one dataset: the engine's drift is the same path in time, the n-th
    request sent the same answer and speed."""
    rng = np.random.default_rng(seed)
    lengths, speeds, drifts = ((np.random.default_rng([seed, stream]) for stream in (1, 2, 3)) if common_luck
                               else (rng, rng, rng))
    clock = Clock()
    fixed = isinstance(level_or_controller, int)
    ctl = None if fixed else level_or_controller(clock)
    dt = max(0.02, duration_s / steps)
    n_slots = engine.n_slots
    # the sequences in slots: sent time, tokens left, tokens in all, prefill left (s), own speed
    sent, left, total = np.zeros(0), np.zeros(0), np.zeros(0)
    prefill, speed, ttft = np.zeros(0), np.zeros(0), np.zeros(0)
    told = np.zeros(0, dtype=bool)  # the controller was told of the sequence's first token
    queue: deque = deque()  # (sent time, tokens, speed) waiting for a slot
    drift, produced, steady_tokens = 0.0, 0.0, 0.0
    series, bucket, next_tick, next_point = [], 0.0, 1.0, every_s or duration_s + 1
    t = before_set = level_set = 0.0
    while t < duration_s:
        knee = engine.moved_knee if engine.move_at is not None and t >= engine.move_at * duration_s else engine.knee
        level = level_or_controller if fixed else ctl.level
        in_flight = len(sent) + len(queue)
        if in_flight > level and not fixed and streamed:  # withdrawn: the youngest sent at the level before
            while queue and len(sent) + len(queue) > level and queue[-1][0] >= before_set:
                queue.pop()
            young = [j for j in np.argsort(sent)[::-1][:len(sent) + len(queue) - level] if sent[j] >= before_set]
            if young:
                lost = float((total[young] - left[young]).sum())  # their tokens so far are thrown away
                produced -= lost
                if hasattr(ctl, "withdrawn"):  # the latency-based alternatives have none
                    ctl.withdrawn(lost)
                steady_tokens -= lost if t >= steady_from * duration_s else 0.0
                keep = np.ones(len(sent), dtype=bool)
                keep[young] = False
                sent, left, total, prefill, speed = sent[keep], left[keep], total[keep], prefill[keep], speed[keep]
                ttft, told = ttft[keep], told[keep]
            in_flight = len(sent) + len(queue)
        if in_flight < level:  # the client sends while the level allows
            k = level - in_flight
            tokens = np.clip(lengths.lognormal(math.log(engine.median_tokens), engine.sigma, k), engine.min_tokens,
                             engine.max_tokens).round()
            for tok, sp in zip(tokens, np.exp(speeds.normal(0, engine.noise, k))):
                queue.append((t, tok, sp))
        while queue and len(sent) < n_slots:
            s0, tok, sp = queue.popleft()
            sent, left, total = np.append(sent, s0), np.append(left, tok), np.append(total, tok)
            active_now = int((prefill <= 0).sum()) if len(prefill) else 0
            prefill = np.append(prefill, engine.ttft_s * max(1.0, active_now / knee) ** 0.5)
            ttft = np.append(ttft, t - s0 + prefill[-1])
            speed = np.append(speed, sp)
            told = np.append(told, False)
        decoding = prefill <= 0
        active = int(decoding.sum())
        drift = drift * math.exp(-dt / 10) + drifts.normal(0, engine.noise / 2 * math.sqrt(2 * dt / 10))
        if not engine.drift:  # drawn all the same, so that the rest of the run's luck stays as it was
            drift = 0.0
        step = engine.step_s(active, knee) * math.exp(drift) if active else 1.0
        progress = np.where(decoding, dt / step / speed, 0.0)
        done_tokens = np.minimum(progress, left)
        made = float(done_tokens.sum())
        produced += made
        bucket += made
        if ctl is not None and streamed:
            for first in ttft[decoding & ~told]:
                ctl.arrived(0, first_s=float(first))
            told = told | decoding
            ctl.arrived(made)
        if t >= steady_from * duration_s:
            steady_tokens += made
        left = left - progress
        prefill = prefill - dt
        finished = left <= 0
        if finished.any():
            when = t + dt + left[finished] * step * speed[finished]  # left <= 0: back to the token's end
            if ctl is not None:
                for w, s0, tok, first in sorted(zip(when, sent[finished], total[finished], ttft[finished])):
                    clock.t = max(w, s0)
                    ctl.completed(int(tok), clock.t - s0, float(first) if streamed else None)
                    if hasattr(ctl, "answered"):  # the latency-based alternatives
                        ctl.answered(int(tok), clock.t - s0)
            keep = ~finished
            sent, left, total, prefill, speed = sent[keep], left[keep], total[keep], prefill[keep], speed[keep]
            ttft, told = ttft[keep], told[keep]
        t += dt
        clock.t = t
        if ctl is not None and t >= next_tick:
            if ctl.tick(len(sent) + len(queue)) is not None:
                before_set, level_set = level_set, t
            next_tick += 1.0
        if t >= next_point:
            series.append((t, level, bucket / every_s))
            bucket, next_point = 0.0, next_point + every_s
    return Result(produced / duration_s, steady_tokens / (duration_s * (1 - steady_from)), series)


def run_length(engine: Engine) -> float:
    """Simulated seconds for a grid point: about 80 request lifetimes at the knee, 10 minutes to 3 hours."""
    return float(min(10800.0, max(600.0, 80 * engine.latency_at(engine.knee))))
