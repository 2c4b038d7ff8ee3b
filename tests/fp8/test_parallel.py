"""The emulated FP8 linears under tensor parallelism (2 gloo processes): megatron-core's
dgrad all-reduce still runs (it comes from its own autograd mappings), so TP=2 training in
FP8 tracks TP=2 fp32 step by step."""

from __future__ import annotations

import pytest

from tests.core.pretrain_runner import FAST, TINY, losses, run_pretrain

pytestmark = pytest.mark.slow

SHAPE = ["model.num_layers=2", "model.ffn_hidden_size=256", "train.global_batch_size=8",
         "train.train_iters=4", "parallel.tensor_model_parallel_size=2"]  # fmt: skip


def test_tp2_fp8_tracks_tp2_fp32(tmp_path):
    run_pretrain(TINY, [*FAST, *SHAPE, f"run.dir={tmp_path / 'fp32'}"], nproc=2)
    run_pretrain(TINY, [*FAST, *SHAPE, f"run.dir={tmp_path / 'fp8'}", "train.fp8=e4m3"], nproc=2)
    ref, fp8 = losses(tmp_path / "fp32"), losses(tmp_path / "fp8")
    assert len(ref) == len(fp8) == 4 and fp8 != ref
    assert ref[-1] < ref[0] - 0.5  # the steps learn, so a wrong dgrad would show
    for a, b in zip(ref, fp8, strict=True):
        assert abs(a - b) / a < 0.01
