"""``trace analyze DIR --out DIR/report`` run again: its own report is not a trace.

The first run writes ``summary.json`` under DIR; the second must neither list it as a bad
trace nor analyze it, and must report what the first did.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from titan_core.trace.cli import main
from titan_core.trace.parse import find_trace_files
from titan_core.trace.synth import write_job

ROOT = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path) -> Path:
    d = tmp_path / "job"
    write_job(d, pp=2, dp=2, m=4, steps=2)
    return d


def _cli(trace_dir: Path, out: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """The command as a user types it; returns summary.json and the finished command."""
    cmd = [sys.executable, "-m", "titan_core.trace", "analyze", str(trace_dir), "--out", str(out)]
    run = subprocess.run(
        [*cmd, "--no-cache", "--quiet", "--workers", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return json.loads((out / "summary.json").read_text()), run


def _main(trace_dir: Path, out: Path) -> dict:
    args = ["analyze", str(trace_dir), "--out", str(out), "--no-cache", "--quiet"]
    assert main([*args, "--workers", "1"]) == 0
    return json.loads((out / "summary.json").read_text())


def test_second_run_does_not_read_its_own_report(tmp_path: Path) -> None:
    d = _job(tmp_path)
    first, _ = _cli(d, d / "report")
    second, run = _cli(d, d / "report")
    assert first["problems"] == [] and second["problems"] == []
    # skipped files are printed to stderr, one line each, naming the file
    assert "summary.json" not in run.stderr and "0 files skipped" in run.stdout
    assert second == first
    assert second["num_ranks"] == 4


@pytest.mark.parametrize("out", [".", "report", "a/b/c"])
def test_reports_anywhere_below_the_traces(tmp_path: Path, out: str) -> None:
    """The report folder is the trace folder itself, or below it; reports of other runs
    with another --out lie there too."""
    d = _job(tmp_path)
    first = _main(d, d / out)
    _main(d, d / "other")  # another run's report, not the current --out
    second = _main(d, d / out)
    assert second["problems"] == [] and second == first
    assert sorted(Path(f).name for f in map(str, find_trace_files(d))) == [
        f"rank-{r}.pt.trace.json.gz" for r in range(4)
    ]


def test_reports_written_before_the_format_key(tmp_path: Path) -> None:
    """A summary.json from a version without its ``format`` key is known by its layout."""
    d = _job(tmp_path)
    first = _main(d, tmp_path / "out")
    old = {k: v for k, v in first.items() if k != "format"}
    (d / "old").mkdir()
    (d / "old" / "summary.json").write_text(json.dumps(old, indent=1))
    assert _main(d, tmp_path / "out") == first


def test_a_trace_named_summary_is_still_a_trace(tmp_path: Path) -> None:
    """Reports are known by their content, not their name."""
    d = _job(tmp_path)
    src = d / "rank-3.pt.trace.json.gz"
    (d / "summary.json").write_bytes(gzip.decompress(src.read_bytes()))
    src.unlink()
    s = _main(d, d / "report")
    assert s["problems"] == [] and s["num_ranks"] == 4
    assert any(r["file"].endswith("summary.json") for r in s["ranks"])
