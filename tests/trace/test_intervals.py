"""The numpy sweeps of large inputs equal the plain-Python ones of small inputs."""

import random

import pytest

from titan_core.trace import intervals as iv


def _random_intervals(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    starts = [rng.randint(0, 200) for _ in range(n)]
    # empty and inverted intervals too (rounding can make a sub-microsecond event one)
    return starts, [s + rng.randint(-2, 25) for s in starts]


def test_numpy_and_python_sweeps_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    cases = []
    for _ in range(2000):
        s, e = _random_intervals(rng, rng.randint(0, 40))
        sets = [iv._merge_py(*_random_intervals(rng, rng.randint(0, 12))) for _ in range(3)]
        cases.append((s, e, sets[: rng.randint(1, 3)]))
    expected = [(iv.merge(s, e), iv.coverage(sets)) for s, e, sets in cases]
    monkeypatch.setattr(iv, "NUMPY_MIN", 0)  # every input takes the numpy path
    for (s, e, sets), (merged, cov) in zip(cases, expected, strict=True):
        assert iv.merge(s, e) == merged, (s, e)
        assert iv.coverage(sets) == cov, sets
    assert iv.merge([3, 1, 9], [5, 3, 9]) == ([1], [5])  # touching join, empty vanish


def test_merge_of_large_input_is_numpy_and_exact() -> None:
    rng = random.Random(1)
    s, e = _random_intervals(rng, 5 * iv.NUMPY_MIN)
    assert iv.merge(s, e) == iv._merge_py(s, e)
    big = [iv._merge_py(*_random_intervals(rng, 3 * iv.NUMPY_MIN)) for _ in range(3)]
    assert iv.coverage(big) == iv._coverage_py(big)
