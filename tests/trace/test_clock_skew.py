"""Pipeline bubbles, critical path and what-if under per-rank clock skew.

Generated PP x DP jobs are analyzed twice, without and with a random skew of several ms
per rank: the offsets recovered must be the injected ones, and everything that compares
events of different ranks must come out as without skew.

Tolerances: the parsed timestamps are whole microseconds, and an offset is read off
differences of such timestamps, so it is exact to ``OFFSET_TOL_US``. Shifting a rank by
at most that moves each end of a window by at most as much, so an idle time by at most
``4 * OFFSET_TOL_US`` (two windows ends, two ends of the rank's own busy time), and a
bubble ratio by that over the shortest schedule window (one stage's own compute,
``M * 3 * T_FWD``), plus the 1e-4 of rounding the ratios to four places.
"""

from __future__ import annotations

import random
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from titan_core.trace.analyze import build_summary, load_ranks
from titan_core.trace.synth import write_job

M, STEPS, T_FWD = 8, 3, 1000.0
SKEW_US = 5000
OFFSET_TOL_US = 2.0
RATIO_TOL = 4 * OFFSET_TOL_US / (M * 3 * T_FWD) + 1e-4


def _summary(d: Path, **kw: Any) -> dict[str, Any]:
    write_job(d, m=M, steps=STEPS, t_fwd=T_FWD, **kw)
    results, problems = load_ranks(d, workers=1, progress=False)
    assert not problems
    return build_summary(results, problems)


@cache
def _pair(pp: int, dp: int, seed: int, jitter: float = 0.0) -> tuple[dict, dict, dict]:
    """(summary without skew, summary with skew, injected skew) of one random job."""
    rng = random.Random(seed)
    world = pp * dp
    skew = {r: float(rng.randint(-SKEW_US, SKEW_US)) for r in range(world)}
    kw = {"pp": pp, "dp": dp, "slow": {rng.randrange(world): 1.3}, "p2p_jitter": jitter}
    kw["seed"] = seed
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        return _summary(Path(a), **kw), _summary(Path(b), clock_skew=skew, **kw), skew


CASES = [(4, 2, seed) for seed in range(3)] + [(2, 4, seed) for seed in range(3)] + [(4, 1, 7)]


@pytest.mark.parametrize(("pp", "dp", "seed"), CASES)
def test_offsets_recovered(pp: int, dp: int, seed: int) -> None:
    _, skewed, skew = _pair(pp, dp, seed)
    off = skewed["clock_offsets_us"]
    assert off["0"] == 0.0  # relative to rank 0
    for r in range(pp * dp):
        assert off[str(r)] == pytest.approx(skew[r] - skew[0], abs=OFFSET_TOL_US)


def _stages(summary: dict) -> dict[int, dict]:
    return {st["rank"]: st for g in summary["pipeline"]["groups"] for st in g["stages"]}


@pytest.mark.parametrize(("pp", "dp", "seed"), CASES)
def test_bubbles_as_without_skew(pp: int, dp: int, seed: int) -> None:
    plain, skewed, _ = _pair(pp, dp, seed)
    want, got = _stages(plain), _stages(skewed)
    assert sorted(got) == list(range(pp * dp))
    for r, st in got.items():
        assert st["bubble_ratio"] == pytest.approx(want[r]["bubble_ratio"], abs=RATIO_TOL)
        assert st["step_bubble_ratio"] == pytest.approx(want[r]["step_bubble_ratio"], abs=RATIO_TOL)
        assert st["bubble_us"] == pytest.approx(want[r]["bubble_us"], abs=4 * OFFSET_TOL_US + 1)
        assert st["compute_us"] == want[r]["compute_us"]
    for gp, gs in zip(plain["pipeline"]["groups"], skewed["pipeline"]["groups"], strict=True):
        for n, (lo, hi) in gs["step_windows"].items():
            plo, phi = gp["step_windows"][n]
            assert hi - lo == pytest.approx(phi - plo, abs=2 * OFFSET_TOL_US)


@pytest.mark.parametrize(("pp", "dp", "seed"), CASES)
def test_bubble_and_compute_fit_in_the_step(pp: int, dp: int, seed: int) -> None:
    _, skewed, _ = _pair(pp, dp, seed)
    # each rank's step time is on its own clock, so skew cannot stretch it
    step = {
        r["rank"]: sum(s["step_time_us"] for s in r["steps"]) / len(r["steps"])
        for r in skewed["ranks"]
    }
    for g in skewed["pipeline"]["groups"]:
        longest = max(step[r] for r in g["ranks"])
        for st in g["stages"]:
            assert st["bubble_us"] + st["compute_us"] <= longest + 1


@pytest.mark.parametrize(("pp", "dp", "seed"), CASES)
def test_critical_path_and_what_if_as_without_skew(pp: int, dp: int, seed: int) -> None:
    plain, skewed, _ = _pair(pp, dp, seed)
    steps_p, steps_s = plain["critical_path"]["steps"], skewed["critical_path"]["steps"]
    assert [s["step"] for s in steps_s] == [s["step"] for s in steps_p]
    tol = 2 * OFFSET_TOL_US
    for a, b in zip(steps_p, steps_s, strict=True):
        assert b["observed_us"] == pytest.approx(a["observed_us"], abs=tol)
        assert b["replayed_us"] == pytest.approx(a["replayed_us"], abs=tol)
        assert b["critical_path"]["length_us"] == pytest.approx(
            a["critical_path"]["length_us"], abs=tol
        )
        want = {w["rank"]: w["saved_us"] for w in a["what_if"]}
        got = {w["rank"]: w["saved_us"] for w in b["what_if"]}
        assert got.keys() == want.keys()
        assert got or dp == 1  # with one rank per stage, no peers to compare speeds with
        for r, v in got.items():
            assert v == pytest.approx(want[r], abs=2 * tol)


@pytest.mark.parametrize("seed", [0, 1])
def test_uneven_transfer_times(seed: int) -> None:
    """P2P transfers of 20-50 us: each stage-to-stage link is off by at most half the
    difference of the two directions' fastest transfers (30 / 2 us), errors add along
    the pipeline; bubbles move by that over the schedule window."""
    pp, dp, jitter = 4, 2, 30.0
    plain, skewed, skew = _pair(pp, dp, seed, jitter)
    off = skewed["clock_offsets_us"]
    tol = (pp - 1) * jitter / 2 + OFFSET_TOL_US
    for r in range(pp * dp):
        assert off[str(r)] == pytest.approx(skew[r] - skew[0], abs=tol)
    want, got = _stages(plain), _stages(skewed)
    for r, st in got.items():
        assert st["bubble_ratio"] == pytest.approx(
            want[r]["bubble_ratio"], abs=4 * tol / (M * 3 * T_FWD) + 1e-4
        )
