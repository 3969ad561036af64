"""The quick dedupe and sample selection give exactly what a full sort gives (random digests with forced duplicates and
forced collisions of their first 8 bytes; keys with many ties)."""
import numpy as np

from drafter_data.prompts.selection import first_occurrences, smallest


def digests_with_collisions(rng: np.random.Generator, n: int) -> np.ndarray:
    d = np.frombuffer(rng.bytes(16 * n), dtype="S16").copy()
    halves = d.view("<u8").reshape(-1, 2)
    for i, j in rng.integers(0, n, (n // 5, 2)):
        d[i] = d[j]  # a true duplicate
    for i, j in rng.integers(0, n, (n // 10, 2)):
        halves[i, 0] = halves[j, 0]  # same first 8 bytes, different digest
    return d


def test_first_occurrences_is_np_unique_first_index():
    rng = np.random.default_rng(7)
    for n in [0, 1, 2, 3, 17, 500, 4000]:
        d = digests_with_collisions(rng, n) if n > 1 else np.frombuffer(rng.bytes(16 * n), dtype="S16")
        expected = np.zeros(n, dtype=bool)
        if n:
            expected[np.unique(d, return_index=True)[1]] = True
        assert (first_occurrences(d) == expected).all(), n


def test_smallest_is_a_stable_sort_prefix():
    rng = np.random.default_rng(8)
    for n in [1, 2, 10, 1000]:
        keys = rng.integers(0, max(2, n // 20), n).astype(np.uint64)  # many ties
        for k in sorted({1, max(1, n // 3), n}):
            expected = np.zeros(n, dtype=bool)
            expected[np.argsort(keys, kind="stable")[:k]] = True
            assert (smallest(keys, k) == expected).all(), (n, k)
