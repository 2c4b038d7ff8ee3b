"""parallel.p2p_transport=mooncake under real PP=2 pretraining (2 processes, gloo + Mooncake
TCP on 127.0.0.1): fp32, same seed, the torch transport's losses exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.core.pretrain_runner import FAST, TINY, run_pretrain
from titan_core.training.metrics import read_metrics

pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine) not installed")
pytestmark = pytest.mark.slow


def _run(tmp: Path, transport: str, layout: list[str], extra: list[str]) -> list[dict]:
    proc = run_pretrain(
        TINY,
        [*FAST, "train.train_iters=3", *layout, *extra, f"run.dir={tmp / transport}",
         f"parallel.p2p_transport={transport}", "parallel.p2p_mooncake_host=127.0.0.1"],
        nproc=2,
    )  # fmt: skip
    # the run really went through Mooncake (and the torch one did not)
    assert ("pipeline P2P over Mooncake" in proc.stdout) == (transport == "mooncake")
    return read_metrics(tmp / transport / "metrics.jsonl")


@pytest.mark.parametrize(
    ("layout", "extra"),
    [
        (["parallel.pipeline_model_parallel_size=2"], []),
        (
            [
                "parallel.pipeline_model_parallel_size=2",
                "parallel.virtual_pipeline_model_parallel_size=2",
            ],
            ["train.eval_interval=2", "train.eval_iters=1"],
        ),
    ],
    ids=["pp2-1f1b", "pp2-vpp2-eval"],
)
def test_mooncake_losses_equal_torch(tmp_path, layout, extra):
    """fp32, same seed: every step's loss (and eval loss) bit-identical across transports."""
    torch_run = _run(tmp_path, "torch", layout, extra)
    mooncake_run = _run(tmp_path, "mooncake", layout, extra)
    keys = ["loss", "grad_norm", "eval/loss"]
    got = [{k: r[k] for k in keys if k in r} for r in mooncake_run]
    want = [{k: r[k] for k in keys if k in r} for r in torch_run]
    assert len(got) == 3
    assert got == want
    if extra:
        assert sum("eval/loss" in r for r in got) == 2
