"""The trace report shows the MoE load the run logged to metrics.jsonl, for the traced steps."""

from __future__ import annotations

import json

from titan_core.trace.analyze import analyze_traces
from titan_core.trace.report import write_report
from titan_core.trace.synth import write_job


def _record(step: int) -> dict:
    return {
        "step": step,
        "loss": 1.0,
        "moe/load_imbalance_layer0": 1.0 + step / 10,
        "moe/load_imbalance_layer10": 1.5,
        "moe/load_imbalance_layer2": 2.0 + step / 100,
        "moe/load_imbalance_max": 2.0 + step / 100,
    }


def test_report_shows_the_traced_steps_load(tmp_path):
    run = tmp_path / "run"  # Titan's layout: run.dir/metrics.jsonl beside run.dir/traces
    write_job(run / "traces", pp=1, dp=2, m=2, steps=3)
    lines = [json.dumps(_record(s)) for s in range(0, 12)] + ['{"step": 12, "lo']  # torn
    (run / "metrics.jsonl").write_text("\n".join(lines))
    summary, results = analyze_traces(run / "traces", workers=1, progress=False)
    traced = sorted({s.step for r in results for s in r.steps})
    assert traced and [row["step"] for row in summary["moe_load"]] == traced
    first = summary["moe_load"][0]
    step = first["step"]
    assert first == {
        "step": step,
        "layer0": round(1.0 + step / 10, 3),
        "layer2": round(2.0 + step / 100, 3),
        "layer10": 1.5,
        "max": round(2.0 + step / 100, 3),
    }
    write_report(summary, results, tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text()
    section = html.split("<h2>MoE expert load")[1].split("<h2>")[0]
    heads = section.split("<tr>")[1]
    assert heads.index("layer0") < heads.index("layer2") < heads.index("layer10")
    assert f"<td>{round(1.0 + step / 10, 3)}</td>" in section


def test_no_moe_metrics_no_section(tmp_path):
    write_job(tmp_path / "traces", pp=1, dp=2, m=2, steps=2)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    summary, results = analyze_traces(tmp_path / "traces", workers=1, progress=False)
    assert summary["moe_load"] == []
    write_report(summary, results, tmp_path / "report.html")
    assert "MoE expert load" not in (tmp_path / "report.html").read_text()
