"""A generated PP job: bubbles, slow rank, critical path and what-if known by construction."""

from pathlib import Path

import numpy as np
import pytest

from titan_core.trace.analyze import build_summary, load_ranks
from titan_core.trace.synth import write_job

PP, DP, M = 4, 2, 8


def _expected_bubbles(sim: dict, groups: list[list[int]], step: int) -> dict[int, float]:
    out = {}
    for g in groups:
        segs = {r: [s for s in sim[r] if s["step"] == step] for r in g}
        compute = {r: [s for s in segs[r] if s["k"] in ("fwd", "bwd")] for r in g}
        # the step window of the group on the compute stream: first kernel to the next step
        lo = min(s["ts"] for r in g for s in compute[r])
        nxt = [s for r in g for s in sim[r] if s["step"] == step + 1 and s["k"] in ("fwd", "bwd")]
        hi = min(s["ts"] for s in nxt)
        for r in g:
            busy = sum(s["end"] - s["ts"] for s in compute[r])
            out[r] = 1 - busy / (hi - lo)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    d = tmp_path_factory.mktemp("pp")
    sim = write_job(d, pp=PP, dp=DP, m=M, steps=3, slow={5: 1.3}, clock_skew={3: 5000.0})
    results, problems = load_ranks(d, workers=1, progress=False)
    assert not problems
    return sim, build_summary(results, problems)


def test_pipeline_groups_and_bubbles(job: tuple[dict, dict]) -> None:
    sim, s = job
    groups = sorted(g["ranks"] for g in s["pipeline"]["groups"])
    assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    want = _expected_bubbles(sim, groups, step=0)
    for g in s["pipeline"]["groups"]:
        assert g["num_microbatches"] == M
        assert g["theoretical_bubble_ratio"]["1f1b"] == pytest.approx((PP - 1) / (M + PP - 1))
        for st in g["stages"]:
            assert st["bubble_ratio"] is not None and 0 < st["bubble_ratio"] < 1
    # step 0 of group [0,2,4,6] (no slow rank): all stages do equal work
    first = next(g for g in s["pipeline"]["groups"] if g["ranks"] == [0, 2, 4, 6])
    ratios = [st["step_bubble_ratio"] for st in first["stages"]]
    assert np.allclose(ratios, np.mean([want[r] for r in first["ranks"]]), atol=0.03)
    # over the schedule window itself, equal stages idle as 1F1B's theory says
    theory = first["theoretical_bubble_ratio"]["1f1b"]
    print([st["bubble_ratio"] for st in first["stages"]], theory)
    assert [st["bubble_ratio"] for st in first["stages"]] == pytest.approx([theory] * PP, abs=0.03)


def test_slow_rank_found_first(job: tuple[dict, dict]) -> None:
    _, s = job
    top = s["slow_ranks"][0]
    assert top["rank"] == 5
    assert top["evidence"]["compute_outlier_steps"] == 3
    assert top["evidence"]["compute_excess_us"] == pytest.approx(3 * 0.3 * M * 3 * 1000.0, rel=0.02)


def test_clock_offset_corrected(job: tuple[dict, dict]) -> None:
    _, s = job
    off = s["clock_offsets_us"]
    # only relative offsets inside a collective are observable: 3 vs its DP peer 2
    assert off["3"] - off["2"] == pytest.approx(5000.0, abs=1.0)


def test_critical_path_and_what_if(job: tuple[dict, dict]) -> None:
    _, s = job
    steps = s["critical_path"]["steps"]
    assert steps
    saved = []
    for st in steps:
        # synthetic sends do not wait for their receiver (NCCL ones do), so the replay is close, not exact
        assert st["replayed_us"] == pytest.approx(st["observed_us"], rel=0.05)
        cp = st["critical_path"]
        total = sum(cp["time_by_kind_us"].values())
        assert total == pytest.approx(st["replayed_us"], rel=0.1)
        # local work split by the compute stream: no rank computes on the path longer than
        # its step's computation (20 us gaps closed)
        assert set(cp["time_by_kind_us"]) <= {"compute", "idle", "comm"}
        computation = {
            str(r["rank"]): next(x for x in r["steps"] if x["step"] == st["step"])["computation_us"]
            for r in s["ranks"]
        }
        for rank, busy in cp["compute_by_rank_us"].items():
            assert busy <= computation[rank] * 1.05, (rank, busy, computation[rank])
        assert max(cp["compute_by_rank_us"], key=lambda k: cp["compute_by_rank_us"][k]) == "5"
        wi = {w["rank"]: w for w in st["what_if"]}
        assert wi[5]["saved_us"] >= 0
        saved.append(wi[5]["saved_us"])
    assert max(saved) > 0.02 * steps[0]["replayed_us"]


def test_cpu_only_pipeline_with_titan_annotations(tmp_path: Path) -> None:
    sim = write_job(tmp_path, pp=2, dp=1, m=4, steps=2, cpu=True)
    results, problems = load_ranks(tmp_path, workers=1, progress=False)
    s = build_summary(results, problems, pp=2)
    assert all(r["compute_stream"] == "cpu" for r in s["ranks"])
    (g,) = s["pipeline"]["groups"]
    assert g["ranks"] == [0, 1] and g["num_microbatches"] == 4
    for st in g["stages"]:
        busy = sum(
            x["end"] - x["ts"]
            for x in sim[st["rank"]]
            if x["step"] == 0 and x["k"] in ("fwd", "bwd")
        )
        lo, hi = g["step_windows"]["0"]
        assert st["bubble_ratio"] == pytest.approx(
            np.mean([1 - busy / (hi - lo), st["bubble_ratio"]]), abs=0.05
        )
    # the peers of gloo:send/recv were inferred from the pipeline and the microbatch phase
    assert s["critical_path"]["steps"][0]["replayed_us"] == pytest.approx(
        s["critical_path"]["steps"][0]["observed_us"], rel=0.02
    )
