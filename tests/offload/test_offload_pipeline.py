"""megatron's fine-grained activation offload through Titan's pretraining step, PP=2 on CPU:
fewer resident saved-activation bytes, gradients bit-identical to no offload (fp32)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import PretrainConfig

BENCH = Path(__file__).resolve().parents[2] / "bench" / "activation_offload.py"


def test_an_unknown_offload_module_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, None, ["train.offload_modules=[mlp]"])
    assert "train.offload_modules" in str(e.value) and "mlp_norm" in str(e.value)


def test_offload_min_tensor_size_reaches_megatron() -> None:
    from titan_core.accelerator.cpu import CpuAccelerator
    from titan_core.models.gpt import build_transformer_config

    cfg = load_config(
        PretrainConfig,
        None,
        ["train.offload_modules=[core_attn]", "train.offload_min_tensor_size=123"],
    )
    tf = build_transformer_config(cfg, CpuAccelerator())
    assert tf.fine_grained_activation_offloading and tf.offload_modules == ["core_attn"]
    assert tf.min_offloaded_tensor_size == 123


def test_recompute_keys_reach_megatron_and_bad_combinations_name_the_keys() -> None:
    from titan_core.accelerator.cpu import CpuAccelerator
    from titan_core.models.gpt import build_transformer_config

    sel = ["train.recompute_granularity=selective", "train.recompute_modules=[mlp,core_attn]"]
    tf = build_transformer_config(load_config(PretrainConfig, None, sel), CpuAccelerator())
    assert tf.recompute_granularity == "selective"
    assert tf.recompute_modules == ["mlp", "core_attn"]
    full = [
        "train.recompute_granularity=full", "train.recompute_method=block",
        "train.recompute_num_layers=1",
    ]  # fmt: skip
    tf = build_transformer_config(load_config(PretrainConfig, None, full), CpuAccelerator())
    assert (tf.recompute_granularity, tf.recompute_method, tf.recompute_num_layers) == (
        "full", "block", 1,
    )  # fmt: skip
    off = build_transformer_config(load_config(PretrainConfig, None, []), CpuAccelerator())
    assert off.recompute_granularity is None
    for bad, key in (
        (["train.recompute_granularity=full"], "train.recompute_method"),
        (["train.recompute_num_layers=2"], "train.recompute_granularity=full"),
        (["train.recompute_granularity=selective", "train.recompute_modules=[]"],
         "train.recompute_modules"),
        (["train.recompute_granularity=selective", "train.recompute_modules=[mpl]"],
         "train.recompute_modules"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
            load_config(PretrainConfig, None, bad)


@pytest.mark.slow
def test_offload_lowers_resident_peak_with_bit_identical_grads(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "rows.json"
    cmd = [
        sys.executable, str(BENCH), "--cases", "off,attention_mlp,attention_mlp+recompute_mlp",
        "--schedules",
        "1F1B PP2,VPP PP2xVPP2", "--steps", "0", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    every = json.loads(out.read_text())
    rows = [r for r in every if r["case"] == "attention_mlp"]
    assert {(r["schedule"], r["rank"]) for r in rows} == {
        (s, rank) for s in ("1F1B PP2", "VPP PP2xVPP2") for rank in (0, 1)
    }
    for r in rows:
        assert r["grads_bit_identical"], r
        assert all(d == 0.0 for d in r["max_abs_grad_diff"]), r
        # both counted steps: megatron's warm-up step and a steady one
        assert all(0 < ratio < 1 for ratio in r["ratio"]), r
        assert all(b > 0 for b in r["peak_offloaded_bytes"]), r
    # the MLP's interior, which no offload switch reaches, recomputed instead: fewer bytes
    # still, the same gradients
    offload_only = {(r["schedule"], r["rank"]): r["peak_resident_bytes"] for r in rows}
    both = [r for r in every if r["case"] == "attention_mlp+recompute_mlp"]
    assert len(both) == 4
    for r in both:
        assert r["grads_bit_identical"], r
        fewer = zip(r["peak_resident_bytes"], offload_only[(r["schedule"], r["rank"])], strict=True)
        assert all(a < b for a, b in fewer), r
