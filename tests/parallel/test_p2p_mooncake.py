"""parallel.p2p_transport=mooncake: the config checks, and megatron-core's P2PCommunicator
calls between two real processes over Mooncake TCP on 127.0.0.1 (exact bytes, buffer growth,
deferred receives, variable shapes), where a silent peer is an error naming its stage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from titan_core.config.pretrain import ParallelConfig

pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine) not installed")

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("p2p_worker.py"))


def test_config_needs_mooncake_installed(monkeypatch):
    import titan_core.config.pretrain as mod

    real = mod.importlib.util.find_spec
    monkeypatch.setattr(
        mod.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("mooncake") else real(name, *a),
    )
    with pytest.raises(ValueError, match=r"parallel.p2p_transport=mooncake.*pip install"):
        ParallelConfig(p2p_transport="mooncake", pipeline_model_parallel_size=2)
    assert ParallelConfig(pipeline_model_parallel_size=2).p2p_transport == "torch"


def test_config_warns_without_pipeline():
    with pytest.warns(UserWarning, match="no effect with parallel.pipeline_model_parallel_size=1"):
        ParallelConfig(p2p_transport="mooncake")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParallelConfig(p2p_transport="mooncake", pipeline_model_parallel_size=2)


@pytest.mark.slow
def test_communicator_cases(tmp_path):
    """megatron's P2PCommunicator calls between two real processes (see p2p_worker.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", WORKER, str(tmp_path)]  # fmt: skip
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO),
        GLOG_minloglevel="2",
    )  # fmt: skip
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    ) as p:  # fmt: skip
        try:
            _, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            raise
    assert p.returncode == 0, err[-5000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        # 1F1B's combined calls, 12 microbatches through 4 slots, 4x the initial buffers
        assert r["1f1b"]["all_equal"] and r["1f1b"]["count"] == 12
        assert r["1f1b"]["ring_grows"] == 1 and r["1f1b"]["staging_grows"] == 2
        # overlap_p2p_comm: deferred receives, handles waited out of order
        assert r["overlap"]["all_equal"]
    assert r1["variable"] == {
        "shapes": [[3, 2, 4], [40, 2, 4], [5, 1, 4]],
        "all_equal": True,
        "dtypes": ["torch.bfloat16"],
    }
    assert "pipeline stage 0 (global rank 0) sent 512 bytes" in r1["mismatch"]["error"]
    assert "1024 were expected" in r1["mismatch"]["error"]
    # the silent peer: each side fails after its 1.5 s timeout, naming the other stage
    assert "no data from pipeline stage 0 (global rank 0) within 1.5s" in r1["silent"]["error"]
    assert "for pipeline stage 1 (global rank 1) to free a slot" in r0["silent"]["error"]


def test_grpo_refuses_the_mooncake_pipeline_naming_the_key() -> None:
    # the GRPO trainer's schedules run over torch; the key must not be silently ignored
    from titan_rl.config import GRPOConfig

    with pytest.raises(ValueError, match=r"parallel\.p2p_transport=mooncake is pretraining's"):
        GRPOConfig.model_validate(
            {"parallel": {"p2p_transport": "mooncake", "pipeline_model_parallel_size": 2}}
        )
