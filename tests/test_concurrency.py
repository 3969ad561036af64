"""generation.concurrency=auto: the level controller finds a server's best level and follows it when it moves,
on a simulated server (deterministic clock) with a throughput knee; the stage runs with it end to end."""
import heapq
import itertools
import json
import math
import random

import pytest

from drafter_data.generation.concurrency import LevelController
from tests.conftest import read_rows, write_prompts
from tests.test_generate import check_exactly_once, gen_args

TOKENS = 40  # per request


class KneeServer:
    """Per-token time grows past `knee` requests in flight (total tokens/s falls), and with `slots`, requests past
    the slots queue (total tokens/s stays flat, latency grows)."""

    def __init__(self, knee: int, token_s: float = 0.02, penalty: float = 1.5, slots: int | None = None):
        self.knee, self.token_s, self.penalty, self.slots = knee, token_s, penalty, slots

    def latency(self, level: int) -> float:
        running = min(level, self.slots) if self.slots else level
        per_token = self.token_s * max(1.0, running / self.knee) ** self.penalty
        decode = TOKENS * per_token
        return decode * (level / running)  # queued requests wait their turn

    def tokens_per_s(self, level: int) -> float:
        return level * TOKENS / self.latency(level)


def simulate(controller: LevelController, server: KneeServer, seconds: int, clock: list) -> list[int]:
    """One tick a second; each second the requests that finish report (Little's law: level / latency per s)."""
    levels, owed = [], 0.0
    for _ in range(seconds):
        clock[0] += 1.0
        latency = server.latency(controller.level)
        owed += controller.level / latency
        while owed >= 1:
            controller.completed(TOKENS, latency)
            owed -= 1
        controller.tick(controller.level)
        levels.append(controller.level)
    return levels


def simulate_requests(controller: LevelController, server: KneeServer, seconds: int, clock: list,
                      flight: list) -> list[int]:
    """Request by request: one sent at level L takes the server's latency at L (for its length, 30 to 48 tokens), and
    a freed slot is filled again at once while the level allows. Unlike in simulate, whose requests all report at the
    tick, a window at a new level fills only as requests sent at it finish, a request's lifetime after the change, as
    on a real server (where the knee that moves is followed slower than in simulate). `flight` holds the requests in
    flight, (finish time, send time, tokens), from one call to the next."""
    levels, lengths = [], itertools.cycle(range(30, 51, 3))
    for _ in range(seconds):
        tick = clock[0] + 1.0
        while True:
            while len(flight) < controller.level:
                tokens = next(lengths)
                finish = clock[0] + server.latency(controller.level) * tokens / TOKENS
                heapq.heappush(flight, (finish, clock[0], tokens))
            if flight[0][0] > tick:
                break
            clock[0], sent, tokens = heapq.heappop(flight)
            controller.completed(tokens, clock[0] - sent)
        clock[0] = tick
        controller.tick(len(flight))
        levels.append(controller.level)
    return levels


def simulate_noisy(controller, knee: int, seconds: int, seed: int, clock: list, ttft_s: float = 1.5,
                   median: int = 150, sigma: float = 1.5) -> int:
    """A server as a real one looks through a window of a few dozen requests: completion lengths long-tailed
    (lognormal, 50 to 8,000 tokens), a time to first token, each request's time off by ~10%; past `knee` in flight
    each token takes longer (KneeServer's penalty), and so does the first one. `controller` is a LevelController on
    `clock` or a fixed level (an int). Returns the tokens completed in `seconds`."""
    fixed = isinstance(controller, int)
    rng, lengths = random.Random(seed), random.Random(seed + 1)
    flight, produced = [], 0
    for _ in range(seconds):
        tick = clock[0] + 1.0
        level = controller if fixed else controller.level
        while True:
            while len(flight) < level:
                tokens = int(min(8000, max(50, lengths.lognormvariate(math.log(median), sigma))))
                slower = max(1.0, level / knee)
                latency = (ttft_s * slower + tokens * 0.02 * slower ** 1.5) * math.exp(rng.gauss(0, 0.1))
                heapq.heappush(flight, (clock[0] + latency, clock[0], tokens))
            if flight[0][0] > tick:
                break
            clock[0], sent, tokens = heapq.heappop(flight)
            produced += tokens
            if not fixed:
                controller.completed(tokens, clock[0] - sent)
        clock[0] = tick
        if not fixed:
            controller.tick(len(flight))
    return produced


def mean_rate(server: KneeServer, levels: list[int]) -> float:
    return sum(server.tokens_per_s(level) for level in levels) / len(levels)


def make(start, clock, low=1, high=256):
    return LevelController.starting_at(start, low, high, clock=lambda: clock[0])


def test_finds_the_knee_from_a_misleading_assessment_and_from_nothing():
    server = KneeServer(knee=12)
    best = max(server.tokens_per_s(level) for level in range(1, 257))
    for start, settle_s in ((16, 60), (64, 150), (None, 60)):
        clock = [0.0]
        levels = simulate(make(start, clock), server, 400, clock)
        assert mean_rate(server, levels[settle_s:]) >= 0.95 * best, (start, levels[settle_s:settle_s + 20])
        assert 10 <= sorted(levels[settle_s:])[len(levels[settle_s:]) // 2] <= 14


def share_of_best(server: KneeServer, levels: list[int]) -> float:
    return mean_rate(server, levels) / max(server.tokens_per_s(level) for level in range(1, 257))


def after_a_move(controller: LevelController, clock: list, server: KneeServer, knee: int, seconds: int) -> list[int]:
    """The levels over `seconds` after the server's knee moves to `knee`."""
    server.knee = knee
    return simulate(controller, server, seconds, clock)


def test_follows_a_knee_that_moves_mid_run():
    server, clock = KneeServer(knee=12), [0.0]
    controller = make(12, clock)
    simulate(controller, server, 200, clock)
    levels = after_a_move(controller, clock, server, 40, 300)
    assert share_of_best(server, levels[100:]) >= 0.9 and max(levels) >= 35
    # and down: 5x too many in flight, every request 10x slower, so each window takes longer
    assert share_of_best(server, after_a_move(controller, clock, server, 8, 600)[300:]) >= 0.9


def test_a_knee_that_moves_up_is_climbed_to_quickly():
    """Past a knee that moved up, tok/s grows in proportion to the level again: the search strides out instead of
    creeping up by the small steps it had settled to, and a stride that lands past the new knee is followed by one
    halfway back, not by the level it came from."""
    server, clock = KneeServer(knee=12), [0.0]
    controller = make(16, clock)
    simulate(controller, server, 60, clock)
    levels = after_a_move(controller, clock, server, 24, 60)
    assert share_of_best(server, levels[10:]) >= 0.9, levels


def test_a_knee_that_moves_up_is_seen_above_the_best_and_strided_to():
    """A knee that moves up leaves the best level's tok/s as it was: only the level above shows it, measuring much
    better than it did a cycle before. From there the search strides by SHIFT_STEP, not in CLIMB_STEPs, and back
    halfway once the curve bends. The bench's case (12 -> 24, from a start at 16), wherever the search is in its cycle
    when the knee moves, request by request (as long as windows last on a real server): 0.91 of the best before."""
    shares = []
    for moved_at in range(20, 62, 3):
        server, clock, flight = KneeServer(knee=12), [0.0], []
        controller = make(16, clock)
        simulate_requests(controller, server, moved_at, clock, flight)
        server.knee = 24
        shares.append(share_of_best(server, simulate_requests(controller, server, 30, clock, flight)[10:]))
    assert sum(shares) / len(shares) >= 0.93, [round(share, 2) for share in shares]


def test_a_better_level_below_an_overshoot_looks_up_when_the_curve_is_still_straight_below_it():
    """Climbing from nothing (4, 8, 16), 16 overshoots the knee and the level halfway back beats it. When tok/s grew
    in proportion from 8 up to that level, nothing lower can be better: the knee lies between it and 16, and the next
    probe goes there, not further down (which cost the bench's cold start 15 s at 9 and 10 for a knee at 12)."""
    for knee in (12, 24):
        server, clock, flight = KneeServer(knee=knee), [0.0], []
        levels = simulate_requests(make(None, clock), server, 40, clock, flight)
        overshoot = levels.index(max(levels[:15]))
        assert min(levels[overshoot:30]) >= 0.9 * knee, (knee, levels)
        assert share_of_best(server, levels[overshoot:]) >= 0.93, (knee, levels)  # 0.90 and 0.91 without


def test_once_settled_the_level_below_is_probed_only_every_third_cycle():
    """A knee that moves down shows at the best level itself; one that moves up only above it. Once a cycle finds
    neither neighbour better at the smallest step, the next two probe only the level above: at a knee of 12 the
    steady share of the best is 0.972 (0.959 when every cycle probed both sides at 11 and 13). The level below is still
    measured, and a best that measures worse sends the search down at once: a knee that slips from 12 to 10 is
    followed within 20 s."""
    for knee in (12, 24):
        server, clock, flight = KneeServer(knee=knee), [0.0], []
        controller = make(knee, clock)
        levels = simulate_requests(controller, server, 400, clock, flight)[100:]
        assert share_of_best(server, levels) >= 0.97, (knee, levels[:40])
        assert 0.08 <= sum(level < knee for level in levels) / len(levels) <= 0.2, levels[:40]
        server.knee = knee * 10 // 12
        after = simulate_requests(controller, server, 60, clock, flight)
        assert share_of_best(server, after[20:]) >= 0.95, (knee, after)


def test_a_level_far_worse_than_the_best_is_decided_on_half_its_requests():
    """A window normally waits for 2 x level requests; one that measures more than half below the best after half a
    level's worth (a level past a knee that just moved down, each request many times slower) is decided then: every
    second there costs tok/s. One less bad waits for all its requests: the first to finish are the short ones, in which
    the time to first token weighs most, and on a real server they read a level as good as the best 30-40% below it."""
    for latency, decided in ((4.0, True), (2.5, False), (1.8, False)):
        clock = [0.0]
        controller = LevelController(level=16, low=1, high=64, clock=lambda: clock[0])
        clock[0] += 2.5
        for _ in range(32):
            controller.completed(TOKENS, 0.8)
        assert controller.tick(16) == 32 and controller.best_rate == pytest.approx(16 * TOKENS / 0.8)
        clock[0] += latency + 0.1
        for _ in range(16):  # half the requests a window at 32 waits for
            controller.completed(TOKENS, latency)
        # 320 tok/s against 800: decided; 512 and 711: not yet
        assert (controller.tick(32) is not None) == decided, latency


def test_a_window_estimates_its_own_noise_from_its_requests():
    """The relative standard error of a window's rate: nil when every request ran at the same tokens/s, whatever
    their lengths (and when the clock saw no time pass); for a mix of requests it agrees with a jackknife estimate
    of the same ratio's error, and halves when the window holds four times as many."""
    def noise(requests):
        clock = [0.0]
        controller = LevelController(level=4, low=1, high=64, clock=lambda: clock[0])
        clock[0] += 100.0
        for tokens, seconds in requests:
            controller.completed(tokens, seconds)
        return controller._window_noise()

    def jackknife(requests):
        tokens, seconds, n = sum(t for t, _ in requests), sum(s for _, s in requests), len(requests)
        leave_one_out = [(tokens - t) / (seconds - s) for t, s in requests]
        mean = sum(leave_one_out) / n
        return math.sqrt((n - 1) / n * sum((r - mean) ** 2 for r in leave_one_out)) / (tokens / seconds)

    assert noise([(100, 2.0), (400, 8.0), (50, 1.0)]) == pytest.approx(0.0, abs=1e-9)
    assert noise([(100, 0.0), (400, 0.0)]) == 0.0
    lengths = random.Random(7)
    mix = [(tokens, 1.5 + tokens * 0.02 * math.exp(lengths.gauss(0, 0.1)))
           for tokens in (int(lengths.lognormvariate(math.log(150), 1.5)) + 1 for _ in range(24))]
    assert noise(mix) > 0.02
    assert noise(mix) == pytest.approx(jackknife(mix), rel=0.15)
    assert noise(mix * 4) == pytest.approx(noise(mix * 16) * 2, rel=0.05)


def test_a_win_within_the_windows_noise_is_measured_again_before_it_is_taken():
    """With windows that read +-6%, a level above that beats the best by 5% is not taken at once: the next cycle
    measures the best, then that level again first; a second win takes it, a loss forgets it, and a tie of the level
    below in between neither replaces it nor is taken. A win past the noise (+20%) is taken at once; so is a 5% win
    when both windows are quiet (not when only one is), and one by a level that beats its own last figure by far
    (the knee moved up)."""
    def settled(noise, best_noise=None):
        controller = LevelController(level=17, low=1, high=64)
        controller.best, controller.best_rate, controller.step = 16, 1000.0, math.log(1.06)
        controller._noise, controller.best_noise = noise, noise if best_noise is None else best_noise
        controller._phase = "first"
        return controller

    def next_cycle(controller, rate=900.0):
        while controller._phase != "best" or controller.level != 16:
            controller.level = controller._next_level(rate)
        controller.level = controller._next_level(1000.0)  # the best again

    controller = settled(0.06)
    controller.level = controller._next_level(1050.0)
    assert controller.level == 15 and controller.best == 16  # the other side
    controller.level = controller._next_level(995.0)  # 15 ties the best: within the noise too
    assert controller.best == 16 and controller.level == 16
    controller.level = controller._next_level(1000.0)  # the best again: the neighbour that won first comes first
    assert controller.level == 17
    controller._next_level(1040.0)
    assert controller.best == 17
    controller = settled(0.06)
    controller.level = controller._next_level(1050.0)
    next_cycle(controller)
    assert controller.level == 17
    controller.level = controller._next_level(980.0)  # lost: forgotten
    next_cycle(controller)
    assert controller.level == 17
    controller._next_level(1050.0)
    assert controller.best == 16  # a new first win, not a second
    for noise, best_noise, rate in ((0.06, None, 1200.0), (0.005, None, 1050.0)):
        controller = settled(noise, best_noise)
        controller._next_level(rate)
        assert controller.best == 17, (noise, best_noise, rate)
    controller = settled(0.005, 0.06)  # the best's window was the noisy one
    controller._next_level(1050.0)
    assert controller.best == 16
    controller = settled(0.06)  # below, once settled (the next cycles would probe only above): 15 comes first
    controller.level, controller.direction = 15, -1
    controller.level = controller._next_level(1000.0)  # 15 ties the best: within the noise
    assert controller.level == 17
    controller.level = controller._next_level(950.0)
    assert controller.level == 16 and controller.best == 16
    assert controller._next_level(1000.0) == 15
    controller = settled(0.06)
    controller.history = [(0.0, 17, 900.0), (1.0, 16, 1000.0)]
    controller._next_level(1050.0)
    assert controller.best == 17


def test_the_best_read_lower_within_the_windows_noise_is_not_taken_for_a_change():
    """The best measured again 32% lower: with quiet windows the server changed (the step grows back to SHIFT_STEP,
    downwards first: 16 -> 11); with windows that read +-15% it is noise (the next probe is a small step away). Once
    settled, 7% lower ends the cycles that only look up (the level below comes next) with quiet windows, not with
    noisy ones."""
    def best_again(noise, up_only=0):
        controller = LevelController(level=16, low=1, high=64)
        controller.best, controller.best_rate, controller.step = 16, 1000.0, math.log(1.06)
        controller._noise = controller.best_noise = noise
        controller._up_only = up_only
        return controller

    assert best_again(0.01)._next_level(680.0) == 11
    assert best_again(0.15)._next_level(680.0) in (15, 17)
    assert best_again(0.01, up_only=2)._next_level(930.0) == 15
    assert best_again(0.15, up_only=2)._next_level(930.0) == 17


def test_on_a_noisy_server_the_level_holds_closer_to_the_best():
    """On a server seen through noisy windows (long-tailed lengths, a long time to first token: simulate_noisy),
    wins within the noise no longer move the level at once: over 25 minutes from nothing and from the knee, six
    seeds, two workloads, auto makes 0.92 of the best fixed level's tokens (each seed against its own); taking every
    win over NOISE at once made 0.88."""
    shares = []
    for knee, ttft_s, median, sigma in ((16, 1.5, 150, 1.5), (8, 3.0, 80, 1.0)):
        for seed in range(6):
            best = max(simulate_noisy(level, knee, 1500, seed, [0.0], ttft_s, median, sigma)
                       for level in (knee - 1, knee, knee + 1))
            for start in (None, knee):
                clock = [0.0]
                tokens = simulate_noisy(make(start, clock), knee, 1500, seed, clock, ttft_s, median, sigma)
                shares.append(tokens / best)
    assert sum(shares) / len(shares) >= 0.905, sorted(shares)[:4]


def test_a_best_measured_across_a_fall_is_measured_again_before_the_other_side_is_probed():
    """The knee falls while the best (17) is being measured: its window, partly before the fall, reads 425 tok/s
    where 274 is now true. The search looks down (11); 11 measures 341, better than 17 now but worse than 425. Levels
    above are only worse after a fall, so the best is measured again (not 26, the other side by the long step, which
    cost 30% of the 30 s after the fall in simulation), and 11 then beats it."""
    controller = LevelController(level=17, low=1, high=64)
    controller.best, controller.best_rate, controller.step = 17, 776.0, math.log(1.06)
    for rate, expected in ((425.0, 11), (341.0, 17), (274.0, 11), (341.0, None)):
        new = controller._next_level(rate)
        assert expected is None or new == expected, (rate, new)
        controller.level = new
    assert controller.best == 11


def test_at_the_upper_bound_the_level_below_is_probed_only_every_third_cycle():
    """With the best at concurrency_max there is no level above to probe: a cycle does not measure the level below
    twice, and once settled, two cycles of three are the best alone (before, the level below was measured twice a
    cycle: 0.956 of the best)."""
    server, clock, flight = KneeServer(knee=24), [0.0], []
    controller = make(None, clock, high=16)
    levels = simulate_requests(controller, server, 400, clock, flight)[100:]
    assert mean_rate(server, levels) / server.tokens_per_s(16) >= 0.975, levels[:40]
    assert 15 in levels and max(levels) == 16
    measured = [level for _, level, _ in controller.history[-40:]]
    assert all(a == 16 or b == 16 for a, b in zip(measured, measured[1:])), measured
    server.knee = 8  # a knee that falls below the bound shows at the best: followed as before
    after = simulate_requests(controller, server, 90, clock, flight)
    assert share_of_best(server, after[10:]) >= 0.93, after


def test_a_level_at_the_upper_bound_that_measures_better_than_before_does_not_send_the_search_far_down():
    """At concurrency_max there is nowhere to stride up to: a bound level that measures more than 6% better than it
    did a window before (noise, or a knee that moved up past the bound) is the best again, and the next probe is the
    climbing step below it (16 -> 13, as without the rule), not the long step a moved knee gets (16 -> 11)."""
    clock = [0.0]
    controller = LevelController(level=16, low=1, high=16, clock=lambda: clock[0])
    controller.best, controller.best_rate, controller.step, controller._phase = 15, 100.0, math.log(1.06), "first"
    controller.history = [(0.0, 16, 95.0), (1.0, 15, 100.0)]
    assert controller._next_level(110.0) == round(16 / 1.25)
    assert controller.best == 16


def test_a_knee_that_moves_up_by_any_amount_is_followed_within_seconds():
    """Climbing in equal steps while tok/s grows with the level, not in growing ones that overshoot the new knee
    (a level past it is slow to measure), whatever the knee and however far it moves."""
    for knee in (6, 8, 10, 12, 16, 20, 28):
        for factor in (1.5, 2, 3):
            server, clock = KneeServer(knee=knee), [0.0]
            controller = make(knee, clock)
            simulate(controller, server, 60, clock)
            levels = after_a_move(controller, clock, server, round(knee * factor), 40)
            assert share_of_best(server, levels[10:]) >= 0.88, (knee, factor, levels)


def test_a_knee_far_above_is_climbed_to_in_steps_that_grow():
    """Equal steps at first, growing from the fourth better level in a row: a knee 25x above is within 90% of the best
    tok/s in about 20 s, not 30."""
    server, clock = KneeServer(knee=8), [0.0]
    controller = make(8, clock)
    simulate(controller, server, 60, clock)
    assert first_within(server, after_a_move(controller, clock, server, 200, 200)) <= 25


def test_a_neighbour_far_worse_than_the_best_sends_the_search_back_to_the_best():
    """A neighbour one small step away measuring far below the best means the server changed (or the neighbour is
    far past the knee): the best is measured again at once, not the other neighbour first."""
    server, clock = KneeServer(knee=12), [0.0]
    controller = make(12, clock)
    simulate(controller, server, 60, clock)
    # the knee falls as the window of a cycle's first neighbour starts (not in a cycle that probes only above: its
    # first neighbour is followed by the best anyway)
    while controller.level == controller.best or controller._phase != "first" or controller._up_only:
        simulate(controller, server, 1, clock)
    best, best_rate, seen = controller.best, controller.best_rate, len(controller.history)
    server.knee = 6
    simulate(controller, server, 30, clock)
    measured = [(level, rate) for _, level, rate in controller.history[seen:]]
    far_worse = next(i for i, (level, rate) in enumerate(measured) if level != best and rate < 0.7 * best_rate)
    assert measured[far_worse + 1][0] == best, measured


def test_a_best_at_the_lowest_levels_still_looks_up():
    """At 2 or 3 in flight the lower neighbour is always far worse (one request less is a third or half of them):
    that is what fewer requests give, not a sign to stop looking; nor may a far-worse side keep the other unseen."""
    for start, server in ((3, KneeServer(knee=12)), (2, KneeServer(knee=40)), (2, KneeServer(knee=1000, slots=64))):
        clock = [0.0]
        levels = simulate(make(start, clock), server, 300, clock)
        assert share_of_best(server, levels[60:]) >= 0.9, (start, levels[60:90])


def test_a_window_of_zero_tokens_does_not_stop_the_search():
    """Windows of empty answers (counted as a token each) between windows of 10-token answers: the rate jumps tenfold
    and back, the level stays within its bounds, and a better level after one is taken."""
    clock = [0.0]
    controller = LevelController(level=8, low=1, high=64, clock=lambda: clock[0])
    for tokens in (0, 10, 0, 0, 10, 10, 0, 10):
        level = controller.level
        for _ in range(200):
            clock[0] += 0.05
            controller.completed(tokens, 0.01)
        clock[0] += 3
        controller.tick(level)
        assert 1 <= controller.level <= 64
    assert controller.best_rate > 0


def test_answers_of_no_tokens_do_not_send_the_level_down():
    """Empty answers, or a server that sends no usage: every window reads 0 tokens. They count as requests served, so
    the level follows requests/s (here in proportion to the level: the server's latency does not change) instead of
    falling to the bottom, where a lower level wins every tie."""
    for start in (None, 16):
        clock = [0.0]
        controller = make(start, clock)
        for _ in range(300):
            clock[0] += 1.0
            for _ in range(controller.level):  # `level` requests of 1 s each finished this second
                controller.completed(0, 1.0)
            controller.tick(controller.level)
        assert controller.level >= 64, (start, controller.level)


def first_within(server: KneeServer, levels: list[int], share: float = 0.9) -> int:
    best = max(server.tokens_per_s(level) for level in range(1, 257))
    return next(i for i, level in enumerate(levels) if server.tokens_per_s(level) >= share * best)


def test_a_knee_that_moves_down_or_a_start_far_above_it_is_left_quickly():
    """The best level re-measured much slower means the server changed (its KV cache filled): the search strides out
    again, downwards first; and from an assessed level it probes downwards first (levels past the knee are the slow
    ones to measure)."""
    for before, after, within_s in ((24, 8, 60), (40, 12, 90)):
        server, clock = KneeServer(knee=before), [0.0]
        controller = make(before, clock)
        simulate(controller, server, 300, clock)
        server.knee = after
        assert first_within(server, simulate(controller, server, 300, clock)) <= within_s, (before, after)
    for start, knee, within_s in ((64, 8, 120), (128, 12, 130)):
        server, clock = KneeServer(knee=knee), [0.0]
        assert first_within(server, simulate(make(start, clock), server, 600, clock)) <= within_s, (start, knee)


def test_a_flat_curve_settles_at_the_smallest_level_that_reaches_it():
    """Past the engine's slots requests only queue: more in flight buys no throughput, only TTFT."""
    server, clock = KneeServer(knee=1000, slots=16), [0.0]
    levels = simulate(make(64, clock), server, 400, clock)
    assert sorted(levels[200:])[len(levels[200:]) // 2] <= 24
    assert mean_rate(server, levels[200:]) >= 0.95 * server.tokens_per_s(16)


def test_stays_within_its_bounds():
    server, clock = KneeServer(knee=100), [0.0]
    levels = simulate(make(None, clock, low=2, high=20), server, 200, clock)
    assert min(levels) >= 2 and max(levels) == 20


def test_the_stage_runs_with_auto_and_logs_its_levels(run_stage, fake_server, tmp_path):
    server = fake_server({"token_delay_s": 0.005, "knee": 6})
    prompts = write_prompts(tmp_path / "in", 200)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=auto",
                                           "generation.concurrency_max=32", "generate.assessment=null"))
    assert f"concurrency: auto, {server.url} starts at 4 (not assessed" in proc.stderr
    assert "without its token counts" not in proc.stderr
    check_exactly_once(prompts, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "run.json").read_text())["completions"] == 200
    assert len(read_rows(tmp_path / "out", "completions-")) == 200


def test_a_server_that_sends_no_usage_is_named_and_auto_still_climbs(run_stage, fake_server, tmp_path):
    """A stream without its usage chunk (a proxy that drops stream_options.include_usage): every answer counts 0
    tokens. Preflight says so, and auto climbs on requests served per second instead of falling to the bottom."""
    server = fake_server({"ttft_s": 0.3, "no_usage": True})
    prompts = write_prompts(tmp_path / "in", 400)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=auto",
                                           "generation.concurrency_max=32", "generate.assessment=null"))
    assert f"warning: {server.url} answered without its token counts (no usage in its stream" in proc.stderr
    rows = read_rows(tmp_path / "out", "completions-")
    assert sorted(r["prompt_id"] for r in rows) == sorted(p["prompt_id"] for p in prompts)
    assert {r["completion_tokens"] for r in rows} == {0}  # as the server (did not) report them
    levels = next(iter(json.loads((tmp_path / "out" / "run.json").read_text())["concurrency_levels"].values()))
    assert max(level for _, level, _ in levels) >= 16, levels


def test_no_usage_warning_when_generate_asks_unstreamed_with_its_token_ids(run_stage, fake_server, tmp_path):
    """llama-server's token ids come only unstreamed, where usage comes with the answer: a stream without usage (the
    probe's) says nothing of generate's requests, which then count their tokens."""
    server = fake_server({"no_usage": True, "token_ids": "llama", "engine": "llama"})
    prompts = write_prompts(tmp_path / "in", 6)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out"))
    assert "(requests are sent unstreamed)" in proc.stderr
    assert "without its token counts" not in proc.stderr
    rows = read_rows(tmp_path / "out", "completions-")
    assert sorted(r["prompt_id"] for r in rows) == sorted(p["prompt_id"] for p in prompts)
    assert all(r["completion_tokens"] > 0 and r["completion_token_ids"] for r in rows)


def test_only_the_assessed_server_starts_at_the_assessed_level(run_stage, fake_server, tmp_path):
    assessed, other = fake_server({"token_delay_s": 0.002}), fake_server({"token_delay_s": 0.002})
    write_prompts(tmp_path / "in", 60)
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"best": {"concurrency": 12, "output_tokens_per_s": 500.0},
                                   "server": {"model": "fake-model", "url": assessed.url, "kind": "remote"}}))
    proc = run_stage("generate", *gen_args(assessed.url, tmp_path / "in", tmp_path / "out",
                                           f"server.base_url=[{assessed.url},{other.url}]",
                                           "generation.concurrency=auto", "generation.concurrency_max=32",
                                           f"generate.assessment={metrics}"))
    assert f"{assessed.url} starts at 12 (the assessed best level)" in proc.stderr
    assert f"{other.url} starts at 4 (not assessed" in proc.stderr


def test_a_minimum_above_the_maximum_is_refused(run_stage, fake_server, tmp_path):
    server = fake_server()
    write_prompts(tmp_path / "in", 4)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=auto",
                                           "generation.concurrency_min=10", "generation.concurrency_max=5"),
                     check=False)
    assert proc.returncode == 1 and "concurrency_min=10 is above generation.concurrency_max=5" in proc.stderr


def test_the_rate_checked_against_the_assessment_is_the_steady_one(run_stage, fake_server, tmp_path):
    """generate's real/projected ratio uses the answers that finished with every slot busy (Little's law at the
    level), as assess measures a steady window: not the first wave's start or the drain, here much faster per
    request (fewer in flight than a knee of 2). At 8 in flight every token takes (8 / 2) ** 1.5 = 8 delays, so the
    server makes at most 1 / delay tok/s."""
    delay = 0.004
    server = fake_server({"token_delay_s": delay, "knee": 2, "reasoning_words": 40, "content_words": 40})
    write_prompts(tmp_path / "in", 40)
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"best": {"concurrency": 8, "output_tokens_per_s": 1 / delay},
                                   "server": {"model": "fake-model", "url": server.url, "kind": "remote"}}))
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.token_ids=off",
                                           f"generate.assessment={metrics}"))
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    steady = summary["steady_output_tokens_per_s"]
    assert 0.6 / delay <= steady <= 1.05 / delay, summary
    assert summary["throughput_vs_assessed"] == pytest.approx(steady * delay)
    assert f"{steady:.1f} with every slot busy: {steady * delay:.2f}x the assessed 250.0" in proc.stderr


def test_a_run_with_fewer_conversations_than_the_level_has_no_steady_rate_to_check(run_stage, fake_server, tmp_path):
    """No answer finishes with every slot busy: no ratio (a whole-run rate would not be the same measure), and the
    summary says why."""
    server = fake_server({"token_delay_s": 0.002})
    write_prompts(tmp_path / "in", 3)
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"best": {"concurrency": 8, "output_tokens_per_s": 100.0},
                                   "server": {"model": "fake-model", "url": server.url, "kind": "remote"}}))
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.token_ids=off",
                                           f"generate.assessment={metrics}"))
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    assert summary["completions"] == 3 and summary["output_tokens_per_s"] > 0
    assert summary["steady_output_tokens_per_s"] is None and summary["throughput_vs_assessed"] is None
    assert "no answer finished with every slot busy, so no steady rate to check against the assessed 100.0" in \
        proc.stderr
