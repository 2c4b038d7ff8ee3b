"""The engines' start-up weights of a fresh run from an HF policy, made of the policy's own
files while the trainer builds (titan_rl/start_weights.py), against the reference: the
trainer's export, which the engines waited for before. The built-in engine loads the same
tensors from both, in the same dtype, and the run's tokenizer reads the same ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.hf_cases import build_hf_model, hf_policy_overrides
from titan_core.config import load_config
from titan_rl.config import GRPOConfig
from titan_rl.start_weights import link_policy, serves_policy_files

REPO = Path(__file__).resolve().parents[2]


def _policy(tmp: Path, family: str, dtype: torch.dtype) -> Path:
    model = build_hf_model(family).to(dtype)
    out = tmp / f"{family}_{str(dtype)[6:]}"
    model.save_pretrained(out)
    return out


def _cfg(tmp: Path, policy: Path, *extra: str) -> tuple[GRPOConfig, list[str]]:
    overrides = [*hf_policy_overrides(policy, seq_length=16), f"run.dir={tmp / 'run'}", *extra]
    return load_config(GRPOConfig, None, overrides), overrides


def _export(tmp: Path, overrides: list[str]) -> Path:
    out = tmp / "export"
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    subprocess.run(
        [sys.executable, str(REPO / "tests/rl/start_weights_worker.py"), "--out", str(out),
         "--", *overrides],
        check=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    return out


def _engine_tensors(path: Path, dtype: str) -> dict[str, torch.Tensor]:
    from titan_rl.engine.runner import load_model

    return {k: v.clone() for k, v in load_model(str(path), dtype).state_dict().items()}


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("llama", torch.float32), ("qwen3_moe", torch.bfloat16)],  # tied; experts, upcast
)
def test_the_policy_files_serve_what_the_export_serves(tmp_path, family, dtype):
    from transformers import AutoTokenizer

    from titan_core.data.tokenizer import build_tokenizer

    cfg, overrides = _cfg(tmp_path, _policy(tmp_path, family, dtype))
    assert serves_policy_files(cfg)
    tok = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model)
    direct = link_policy(cfg, tok)
    exported = _export(tmp_path, overrides)

    ours, theirs = _engine_tensors(direct, "auto"), _engine_tensors(exported, "auto")
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    text = "12+30= 42\n"
    assert (
        AutoTokenizer.from_pretrained(str(direct)).encode(text, add_special_tokens=False)
        == AutoTokenizer.from_pretrained(str(exported)).encode(text, add_special_tokens=False)
        == tok.encode(text)
    )


def test_the_engines_wait_for_the_export_where_it_would_differ(tmp_path):
    fp32 = _policy(tmp_path, "qwen3", torch.float32)
    assert serves_policy_files(_cfg(tmp_path, fp32)[0])
    assert serves_policy_files(_cfg(tmp_path, fp32, "engines.dtype=bfloat16")[0])
    # a bf16 trainer holds fp32 weights rounded: its export differs from the files
    assert not serves_policy_files(_cfg(tmp_path, fp32, "train.bf16=true")[0])
    bf16 = _policy(tmp_path, "qwen3", torch.bfloat16)
    assert serves_policy_files(_cfg(tmp_path, bf16, "train.bf16=true")[0])
    # bf16 files upcast by an fp32 trainer: "auto" reads the dtype config.json declares; a
    # config without one would leave the engine the weights' own dtype, which the export changes
    assert serves_policy_files(_cfg(tmp_path, bf16)[0])
    conf = json.loads((bf16 / "config.json").read_text())
    conf.pop("dtype", None), conf.pop("torch_dtype", None)
    (bf16 / "config.json").write_text(json.dumps(conf))
    assert not serves_policy_files(_cfg(tmp_path, bf16)[0])
    assert serves_policy_files(_cfg(tmp_path, bf16, "engines.dtype=float32")[0])
    # a resumed run serves its checkpoint's weights
    cfg = _cfg(tmp_path, fp32)[0]
    ckpt = Path(cfg.run.dir) / "checkpoints"
    (ckpt / "iter_0000003").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    assert not serves_policy_files(cfg)  # (a damaged one too: the trainer's resume says so)
    # a Titan checkpoint is not HF files
    assert not serves_policy_files(_cfg(tmp_path, fp32, "policy.format=titan")[0])
