"""bench/concurrency_sim.py: with common luck, runs of one seed share their luck whatever the level, so that the grid
(bench/concurrency_grid.py --common-luck) compares auto and the fixed levels on the same server and dataset."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.concurrency_sim import Engine, simulate  # noqa: E402

# a plateau of 6 slots: any level from 6 up keeps the same 6 slots busy, the rest only queue
PLATEAU = Engine(knee=6, sharpness="plateau", median_tokens=400, sigma=1.0, ttft_s=0.3, noise=0.25)


def steady_at(levels, common_luck):
    return [simulate(PLATEAU, lv, 600.0, 0, steps=2000, common_luck=common_luck).steady for lv in levels]


def test_levels_past_a_plateau_read_alike_on_common_luck_and_apart_without():
    paired, unpaired = steady_at((6, 8, 24), True), steady_at((6, 8, 24), False)
    assert max(paired) == min(paired), paired
    assert len(set(unpaired)) == 3, unpaired


def test_a_level_that_differs_still_reads_its_own_rate_on_common_luck():
    below, at = steady_at((3, 6), True)
    assert 0.4 < below / at < 0.6, (below, at)  # half the slots busy: about half the tokens
