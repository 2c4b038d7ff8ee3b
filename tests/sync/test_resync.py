"""WeightSync.resync to an engine its supervisor restarted (kill -9) on its start-up weights:
over the distributed transport (the trainer's old process group with the dead engine is
dropped and a new one formed) and the disk transport, the restarted engine alone gets the
trainer's weights as the current version and scores the probe like the trainer; the other
engine is untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sync.test_sync import tiny_qwen3

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_restarted_engine_gets_the_current_weights_over_each_transport(tmp_path: Path) -> None:
    model = tiny_qwen3(tmp_path / "model", seed=0)
    out, log = tmp_path / "out.json", tmp_path / "worker.log"
    transports = ["distributed", "disk"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, str(REPO / "tests/sync/resync_worker.py"), "--model-dir", str(model),
             "--log-dir", str(tmp_path), "--out", str(out), "--transports", *transports],
            stdout=f, stderr=subprocess.STDOUT, env=env, timeout=600,
        )  # fmt: skip
    assert proc.returncode == 0, log.read_text()[-5000:]
    results = json.loads(out.read_text())
    assert [r["transport"] for r in results] == transports
    for i, r in enumerate(results):
        version = f"v{i + 1}"
        assert r["after_kill"] == ["0", version], r  # restarted on its start-up weights
        m = r["resync"]
        assert m["resync/buckets"] > 1 and m["resync/bytes"] > 0, r
        assert m["resync/logprob_abs_diff_max"] < 1e-4, r
        assert r["check"]["sync/logprob_abs_diff_max"] < 1e-4, r  # both engines
        assert r["versions"] == [version, version] and r["sync_version"] == version, r
