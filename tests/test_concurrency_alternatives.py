"""bench/concurrency_alternatives.py's paired searches: HybridController pairs its comparisons only while the usual
first-token wait is under WINDOW_S and is auto's search past it; PairedController always pairs."""
from bench.concurrency_alternatives import HybridController, PairedController
from drafter_data.generation.concurrency import WINDOW_S, LevelController
from tests.test_concurrency import window


def levels_visited(cls, first_s: float, windows: int = 40) -> list[int]:
    """The level of each window on a curve peaking at 16 (each answer's first token `first_s` after it was sent)."""
    clock = [0.0]
    controller = cls(level=16, low=1, high=64, clock=lambda: clock[0])
    levels = []
    for _ in range(windows):
        level = controller.level
        levels.append(level)
        window(controller, clock, 1000.0 * min(level, 16) / max(1.0, level / 16) ** 2, first_s=first_s)
    return levels


def test_hybrid_pairs_while_the_first_token_wait_is_short_and_is_auto_past_it():
    short, long = 0.5, WINDOW_S + 1.0
    paired = levels_visited(HybridController, short)
    assert paired == levels_visited(PairedController, short)
    # paired: every probe away from the best is followed by a window at the best (its other side)
    assert all(b == 16 for a, b in zip(paired, paired[1:]) if a != 16), paired
    unpaired = levels_visited(HybridController, long)
    assert unpaired == levels_visited(LevelController, long)
    assert any(a != 16 and b != 16 for a, b in zip(unpaired, unpaired[1:])), unpaired  # auto narrows off the best
