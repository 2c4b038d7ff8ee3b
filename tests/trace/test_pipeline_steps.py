"""Pipeline bubbles of multi-step traces whose ranks' steps overlap.

Without a barrier between steps (``write_job(packed=True)``) each rank starts its next step
as soon as its own all-reduce is done: the last stages, done first, post the next step's
receives while the first stages still run this step's backwards, so the ranks' own step
ranges overlap (by ~6 ms on a 34 ms step here). The truth is computed from the generator's
own segments, on the true clock: per step, the group's window runs from the step's first
computation on any stage to the next step's first computation (the last step: to the
group's last event), the schedule window from the step's first microbatch start to its
last microbatch end; a stage's bubble is the part of a window in which it computes
nothing.
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from titan_core.trace.analyze import build_summary, load_ranks
from titan_core.trace.synth import write_job

PP, DP, M, STEPS = 4, 2, 8, 3
COMPUTE = ("fwd", "bwd", "opt")
#: the offsets recovered are exact to ~2 us (whole-us timestamps), the ratios rounded to 1e-4
TOL = 1e-3


def _busy(segs: list[dict[str, Any]], kinds: tuple[str, ...], lo: float, hi: float) -> float:
    """Length of the union of ``segs`` of ``kinds`` inside [lo, hi)."""
    spans = sorted((max(s["ts"], lo), min(s["end"], hi)) for s in segs if s["k"] in kinds)
    total, cur = 0.0, None
    for a, b in spans:
        if b <= a:
            continue
        if cur is None or a > cur[1]:
            total += 0 if cur is None else cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (0 if cur is None else cur[1] - cur[0])


def _truth(sim: dict[int, list[dict[str, Any]]], group: list[int]) -> dict[str, Any]:
    """Per step: the windows, and per rank (bubble_ratio, step_bubble_ratio)."""
    segs = [s for r in group for s in sim[r]]

    def of_step(n: int, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
        return [s for s in segs if s["step"] == n and s["k"] in kinds]

    out: dict[str, Any] = {"windows": {}, "sched": {}, "ratios": {r: [] for r in group}}
    for n in range(STEPS):
        mbs = of_step(n, ("fwd", "bwd"))
        slo, shi = min(s["ts"] for s in mbs), max(s["end"] for s in mbs)
        lo = min(s["ts"] for s in of_step(n, COMPUTE))
        if n + 1 < STEPS:
            hi = min(s["ts"] for s in of_step(n + 1, COMPUTE))
        else:
            hi = max(s["end"] for s in segs if s["step"] == n and s["k"] != "step")
        out["windows"][n], out["sched"][n] = (lo, hi), (slo, shi)
        for r in group:
            sched = 1 - _busy(sim[r], ("fwd", "bwd"), slo, shi) / (shi - slo)
            whole = 1 - _busy(sim[r], COMPUTE, lo, hi) / (hi - lo)
            out["ratios"][r].append((sched, whole))
    return out


CASES = {
    "packed": {},
    "packed-skew": {"clock_skew": {1: 4000.0, 2: -3000.0, 3: 5000.0, 6: 2500.0}},
    "packed-slow-skew": {"slow": {5: 1.3}, "clock_skew": {3: 5000.0, 4: -3000.0}},
    "packed-no-mb-ranges": {"microbatch_ranges": False, "clock_skew": {3: 5000.0}},
    # the last stage's optimizer runs past the first stage's next forward
    "packed-straddle": {"optimizer": {6: 8000.0, 7: 8000.0}, "clock_skew": {2: 3000.0}},
    "barrier": {"slow": {5: 1.3}, "clock_skew": {3: 5000.0}},
}


@cache
def _job(case: str) -> tuple[dict, dict]:
    kw = dict(CASES[case])
    packed = case != "barrier"
    with tempfile.TemporaryDirectory() as d:
        sim = write_job(Path(d), pp=PP, dp=DP, m=M, steps=STEPS, packed=packed, **kw)
        results, problems = load_ranks(d, workers=1, progress=False)
    assert not problems
    return sim, build_summary(results, problems)


def test_packed_steps_overlap_on_the_ranks() -> None:
    """What the cases are about: one rank's step N+1 starts before another's step N ends."""
    sim, _ = _job("packed")
    for n in range(STEPS - 1):
        ends = [
            s["end"] for r in (0, 2, 4, 6) for s in sim[r] if s["k"] == "step" and s["step"] == n
        ]
        starts = [
            s["ts"] for r in (0, 2, 4, 6) for s in sim[r] if s["k"] == "step" and s["step"] == n + 1
        ]
        assert min(starts) < max(ends) - 5000


@pytest.mark.parametrize("case", list(CASES))
def test_bubbles_per_step_and_overall(case: str) -> None:
    sim, s = _job(case)
    groups = s["pipeline"]["groups"]
    assert sorted(g["ranks"] for g in groups) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for g in groups:
        want = _truth(sim, g["ranks"])
        assert g["steps"] == list(range(STEPS))
        for st in g["stages"]:
            ratios = want["ratios"][st["rank"]]
            whole = [b for _, b in ratios]
            sched = [a for a, _ in ratios] if CASES[case].get("microbatch_ranges", True) else whole
            # overall (the mean over the steps), then step by step
            assert st["step_bubble_ratio"] == pytest.approx(sum(whole) / STEPS, abs=TOL), case
            assert st["bubble_ratio"] == pytest.approx(sum(sched) / STEPS, abs=TOL), case
            got = [(x["step"], x["bubble_ratio"], x["step_bubble_ratio"]) for x in st["by_step"]]
            assert [x[0] for x in got] == list(range(STEPS))
            assert [x[2] for x in got] == pytest.approx(whole, abs=TOL), st["rank"]
            assert [x[1] for x in got] == pytest.approx(sched, abs=TOL), st["rank"]
        for n, (lo, hi) in want["windows"].items():
            assert g["step_windows"][str(n)] == pytest.approx([lo, hi], abs=3)


@pytest.mark.parametrize("case", ["packed", "packed-skew", "packed-slow-skew"])
def test_windows_take_in_no_next_step_work(case: str) -> None:
    """On the common clock (rank 0's, which is unskewed here), every stage's computation
    of step N lies in step N's window, none of step N+1's."""
    sim, s = _job(case)
    for g in s["pipeline"]["groups"]:
        w = {int(n): v for n, v in g["step_windows"].items()}
        for r in g["ranks"]:
            for seg in sim[r]:
                if seg["k"] in COMPUTE:
                    lo, hi = w[seg["step"]]
                    assert lo - 3 <= seg["ts"] and seg["end"] <= hi + 3, (r, seg)


def test_one_step_and_three_steps_agree() -> None:
    """The same job traced over one step and over three: the same bubbles."""
    _, three = _job("packed")
    with tempfile.TemporaryDirectory() as d:
        write_job(Path(d), pp=PP, dp=DP, m=M, steps=1, packed=True)
        results, problems = load_ranks(d, workers=1, progress=False)
        one = build_summary(results, problems)
    for g1, g3 in zip(one["pipeline"]["groups"], three["pipeline"]["groups"], strict=True):
        for a, b in zip(g1["stages"], g3["stages"], strict=True):
            assert a["bubble_ratio"] == pytest.approx(b["bubble_ratio"], abs=TOL)
            # the last of three steps ends at the group's last event, as the only one does
            # (steps 0 and 1 also hold the 100 us before the first stage's next forward)
            assert b["by_step"][-1]["step_bubble_ratio"] == pytest.approx(
                a["step_bubble_ratio"], abs=TOL
            )
