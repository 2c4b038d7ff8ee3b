"""HF <-> Megatron mapping: same logits as transformers (fp32, 1e-4) and exact round trips.

Each family's tiny random model is loaded into megatron-core at TP=1 (one process) and at
TP=2 (torchrun, gloo); PP=2 and EP=2 check the exporter's collect over stages and experts
(the three 2-process layouts in one torchrun).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.hf_cases import save_case
from titan_core.config.loader import ConfigError
from titan_core.models.hf import HFBridge, model_config_from_hf

REPO = Path(__file__).resolve().parents[2]
WORKER = str(REPO / "tests" / "models" / "hf_worker.py")
FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: save_case(f, root)[0] for f in FAMILIES}


def run_worker(tmp: Path, dirs: list[Path], nproc: int, *flags: str) -> dict:
    out = tmp / "result.json"
    if nproc == 1:
        cmd = [sys.executable, WORKER]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), WORKER]  # fmt: skip
    cmd += [*flags, str(out), *map(str, dirs)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
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
    return json.loads(out.read_text())


def check(results: dict, families: list[str], logits: bool = True) -> None:
    assert sorted(results) == sorted(families)
    for fam, r in results.items():
        assert r["missing"] == [] and r["extra"] == [], (fam, r)
        assert r["unequal"] == [], (fam, r["unequal"])
        assert r["num_buckets"] > 1, "the tiny bucket size should split the export"
        assert r["oversized_buckets"] == 0
        if logits:
            assert r["logit_max_abs_diff"] < 1e-4, (fam, r["logit_max_abs_diff"])


def test_tp1_logits_and_round_trip(cases: dict[str, Path], tmp_path: Path) -> None:
    check(run_worker(tmp_path, list(cases.values()), 1), FAMILIES)


#: the 2-process layouts and the families each loads: PP=2 a tied (output layer on the last
#: stage) and an untied one, EP=2 the MoE
TWO_RANKS = {
    "tp2": ({"tp": 2, "pp": 1, "ep": 1}, FAMILIES),
    "pp2": ({"tp": 1, "pp": 2, "ep": 1}, ["llama", "qwen2"]),
    "ep2": ({"tp": 1, "pp": 1, "ep": 2}, ["qwen3_moe"]),
}


@pytest.fixture(scope="module")
def two_ranks(cases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every layout of TWO_RANKS in one torchrun of 2 processes (the worker makes
    megatron's groups again for each): ``{layout: {family: result}}``."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    plan = {
        name: {**layout, "dirs": [str(cases[f]) for f in fams]}
        for name, (layout, fams) in TWO_RANKS.items()
    }
    (tmp / "plan.json").write_text(json.dumps(plan))
    return run_worker(tmp, [], 2, "--plan", str(tmp / "plan.json"))


@pytest.mark.slow
def test_tp2_logits_and_round_trip(two_ranks: dict) -> None:
    check(two_ranks["tp2"], FAMILIES)


@pytest.mark.slow
def test_pp2_export_collects_stages(two_ranks: dict) -> None:
    check(two_ranks["pp2"], TWO_RANKS["pp2"][1], logits=False)


@pytest.mark.slow
def test_ep2_logits_and_round_trip(two_ranks: dict) -> None:
    check(two_ranks["ep2"], ["qwen3_moe"])


# ---- in-process unit checks (no process groups) ------------------------------------------


def test_model_config_from_hf(cases: dict[str, Path]) -> None:
    m = model_config_from_hf(cases["qwen3_moe"])
    assert (m.num_query_groups, m.kv_channels, m.num_moe_experts, m.moe_router_topk) == (
        2,
        32,
        4,
        2,
    )
    assert m.qk_layernorm and m.untie_embeddings_and_output_weights and not m.add_qkv_bias
    assert not model_config_from_hf(cases["llama"]).untie_embeddings_and_output_weights
    assert model_config_from_hf(cases["qwen2"]).add_qkv_bias


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model_type": "gpt2"}, "no Megatron mapping"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "RoPE scaling"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"hidden_act": "gelu"}, "silu"),
    ],
)
def test_unsupported_configs_are_named(cases: dict[str, Path], patch: dict, message: str) -> None:
    hf = json.loads((cases["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf({**hf, **patch})


def test_qkv_interleave_round_trip(cases: dict[str, Path]) -> None:
    b = HFBridge(cases["qwen3"])
    q, k, v = torch.randn(128, 64), torch.randn(64, 64), torch.randn(64, 64)
    fused = b.merge_qkv(q, k, v)
    # group 0 = q heads 0-1 (2 x 32 rows), then k head 0, then v head 0
    assert torch.equal(fused[:64], q[:64]) and torch.equal(fused[64:96], k[:32])
    assert torch.equal(fused[96:128], v[:32]) and torch.equal(fused[128:192], q[64:])
    assert all(torch.equal(a, c) for a, c in zip(b.split_qkv(fused), (q, k, v), strict=True))
