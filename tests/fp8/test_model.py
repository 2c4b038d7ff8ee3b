"""``train.fp8`` on CPU: the emulation is selected, installed on the decoder's GEMMs, and a
tiny GPT's training loss stays close to fp32's; GPU keeps megatron-core + TE."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.core.pretrain_runner import FAST, TINY, losses, run_pretrain
from titan_core.accelerator.cpu import CpuAccelerator
from titan_core.accelerator.cuda import CudaAccelerator
from titan_core.config.loader import ConfigError
from titan_core.config.pretrain import PretrainConfig
from titan_core.models.gpt import build_transformer_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.ffn_hidden_size=256", "train.lr_warmup_iters=1"]


def _cfg(**train: object) -> PretrainConfig:
    return PretrainConfig.model_validate({"train": train})


def test_cpu_selects_the_emulation_instead_of_an_error():
    tf = build_transformer_config(_cfg(fp8="e4m3"), CpuAccelerator())
    assert tf.fp8 is None  # megatron-core's own FP8 (TE) stays off; the GEMMs are swapped


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8"])
def test_cpu_refuses_recipes_it_does_not_emulate(recipe):
    with pytest.raises(ConfigError, match=f"train.fp8_recipe={recipe}.*only blockwise"):
        build_transformer_config(_cfg(fp8="e4m3", fp8_recipe=recipe), CpuAccelerator())


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="checks a GPU machine without Transformer Engine",
)
def test_gpu_without_te_is_still_an_error():
    with pytest.raises(ConfigError, match="needs Transformer Engine"):
        build_transformer_config(_cfg(fp8="e4m3"), CudaAccelerator())


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs a CUDA GPU with Transformer Engine (megatron-core's own FP8 path)",
)
def test_gpu_keeps_megatron_core_te_blockwise():
    from megatron.core.fp8_utils import get_fp8_recipe
    from transformer_engine.common.recipe import Float8BlockScaling

    tf = build_transformer_config(_cfg(fp8="e4m3"), CudaAccelerator())
    assert (tf.fp8, tf.fp8_recipe) == ("e4m3", "blockwise")
    assert isinstance(get_fp8_recipe(tf), Float8BlockScaling)


def _built(*overrides: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fp8.build_worker", *overrides],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_decoder_and_expert_gemms_are_switched_embedding_and_output_are_not():
    built = _built(
        "train.fp8=e4m3", "model.num_layers=2", "model.ffn_hidden_size=256",
        "model.num_moe_experts=2", "model.moe_ffn_hidden_size=128", "model.moe_layer_freq=2",
    )  # fmt: skip
    assert built["tf_fp8"] is None
    # layer 0 MoE (SequentialMLP experts: parallel linears; the router stays high precision),
    # layer 1 dense
    expected = {
        "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj",
        "decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.self_attention.linear_proj",
        "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc2",
    } | {
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{i}" for e in (0, 1) for i in (1, 2)
    }  # fmt: skip
    assert set(built["switched"]) == expected
    assert set(built["linears"]) - expected == {"output_layer"}
    assert _built("model.num_layers=1")["switched"] == []


@pytest.mark.slow
def test_tiny_gpt_trains_in_fp8_close_to_fp32(tmp_path):
    steps = ["train.train_iters=6", "checkpoint.save_interval=0"]
    run_pretrain(TINY, [*FAST, *SMALL, *steps, f"run.dir={tmp_path / 'fp32'}"])
    run_pretrain(TINY, [*FAST, *SMALL, *steps, f"run.dir={tmp_path / 'fp8'}", "train.fp8=e4m3"])
    ref, fp8 = losses(tmp_path / "fp32"), losses(tmp_path / "fp8")
    assert len(ref) == len(fp8) == 6
    assert fp8 != ref  # the GEMMs really ran quantized
    assert ref[-1] < ref[0] - 0.5 and fp8[-1] < fp8[0] - 0.5  # both learn
    for a, b in zip(ref, fp8, strict=True):
        assert abs(a - b) / a < 0.02
