"""Without Transformer Engine the GPT layers' core attention runs through the fused SDPA
kernel (titan_core/models/sdpa_attention.py): the same logits and gradients as megatron-core's
own ``DotProductAttention`` on the same weights, dense and MoE, with and without grouped KV."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compared(*overrides: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.core.sdpa_worker", *overrides],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "overrides",
    [
        ("model.num_query_groups=2", "model.qk_layernorm=true"),
        ("model.num_attention_heads=4", "model.num_query_groups=4"),
        (
            "model.num_moe_experts=2",
            "model.moe_ffn_hidden_size=64",
            "model.moe_layer_freq=2",
            "model.num_query_groups=2",
        ),
        ("model.attention_dropout=0.3",),  # dropout acts in training: compared in eval only
    ],
    ids=["gqa-qk-norm", "mha", "moe-block-spec", "dropout"],
)
def test_titans_core_attention_matches_megatrons_own(overrides: tuple[str, ...]) -> None:
    got = _compared("model.num_layers=2", *overrides)
    assert got["titan"] == ["SDPAttention"] and got["megatron"] == ["DotProductAttention"]
    modes = ["eval"] if "model.attention_dropout=0.3" in overrides else ["train", "eval"]
    for mode in modes:
        r = got[mode]
        assert r["same_grads"]
        assert r["logits"] <= 1e-5 * max(1.0, r["logits_scale"]), r
        assert r["grads"] <= 1e-4, r
