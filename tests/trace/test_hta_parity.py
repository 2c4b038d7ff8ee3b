"""kernel_time_us equals HTA's GPU kernel breakdown (union per category) within 0.5%."""

import logging
import shutil
from pathlib import Path

import pytest

from titan_core.trace.analyze import build_summary, load_ranks

CASES = [
    pytest.param("nccl_parser_config", id="nccl_data"),
    pytest.param("trace_filter", id="sampled_ranks"),
    pytest.param("trace_diff/control", id="control", marks=pytest.mark.slow),
    pytest.param("df_index_resolver", id="df_index_resolver", marks=pytest.mark.slow),
]


def _hta_sums(trace_dir: Path) -> dict[str, float]:
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis not installed")
    logging.disable(logging.WARNING)
    try:
        ta = hta.TraceAnalysis(trace_dir=str(trace_dir))
        kt, _ = ta.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
    finally:
        logging.disable(logging.NOTSET)
    sums = {"computation": 0.0, "communication": 0.0, "memory": 0.0}
    for row in kt.itertuples():
        for kind in sums:
            if kind.upper() in row.kernel_type.split(" overlapping "):
                sums[kind] += row.sum
    return sums


@pytest.mark.parametrize("sub", CASES)
def test_kernel_time_matches_hta(traces: Path, tmp_path: Path, sub: str) -> None:
    src = traces / sub
    # HTA reads every file of the folder; copy so both see exactly the same files
    work = tmp_path / "t"
    shutil.copytree(src, work)
    expected = _hta_sums(work)
    results, problems = load_ranks(work, workers=1, progress=False)
    assert not problems
    summary = build_summary(results, problems)
    ours = {k: sum(r["kernel_time_us"][k] for r in summary["ranks"]) for k in expected}
    assert expected["computation"] > 0
    for kind, want in expected.items():
        assert ours[kind] == pytest.approx(want, rel=0.005, abs=2), (kind, ours, expected)
