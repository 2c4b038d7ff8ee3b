"""metrics.jsonl on resume: the records of steps a run repeats are dropped, once."""

from __future__ import annotations

import json

from titan_core.training.metrics import MetricsWriter, drop_records_after, read_metrics


def test_records_past_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step in range(0, 5):
        writer.write({"step": step, "loss": float(step)})
    writer.write({"note": "no step"})
    writer.close()
    with open(path, "ab") as f:
        f.write(b'{"step": 5, "lo')  # torn by a kill
    assert drop_records_after(path, 2) == 3  # steps 3 and 4, and the torn line
    assert [r.get("step") for r in read_metrics(path)] == [0, 1, 2, None]
    assert path.read_text().endswith("\n") and not (tmp_path / "metrics.jsonl.tmp").exists()
    assert drop_records_after(path, 2) == 0  # nothing left to drop: the file is untouched
    assert drop_records_after(path, -1) == 3  # a fresh start keeps no step
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"note": "no step"}]
    assert drop_records_after(tmp_path / "missing.jsonl", 0) == 0
