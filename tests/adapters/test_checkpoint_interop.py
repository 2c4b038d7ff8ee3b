"""Checkpoints that interoperate (issue 32 part 3): what slime's Titan actor saves is a
megatron-core ``torch_dist`` checkpoint in Megatron-LM's layout, with the common state
Megatron-LM's ``load_checkpoint`` reads; Titan loads a release checkpoint as slime's
converter lays it out; ``--save-hf`` writes HF snapshots transformers loads with the
trainer's logits; ``--save-retain-interval`` prunes as Megatron-LM does."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.hf_cases import COMMON, build_hf_model

pytest.importorskip("slime.ray.train_actor", reason="slime's wheel (../shared/peers) is needed")

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """The worker's folder, the HF model it started from, and its result."""
    root = tmp_path_factory.mktemp("interop")
    model_dir = root / "model"
    build_hf_model("llama").save_pretrained(model_dir)
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/adapters/checkpoint_interop_worker.py"),
         "--model-dir", str(model_dir), "--out", str(root)],
        capture_output=True, text=True, cwd=REPO, timeout=600, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return root, model_dir, torch.load(root / "result.pt", weights_only=False)


def test_layout_and_retain_interval(run) -> None:
    """iter_XXXXXXX folders numbered by rollout id (as slime's and miles' actors save), the
    tracker naming the newest; with --save-retain-interval 2, Megatron-LM's rule: each save
    deletes the previous one unless its iteration is 0 or a multiple of 2."""
    root, _, res = run
    ckpt = root / "ckpt"
    assert res["kept"] == ["iter_0000000", "iter_0000002", "iter_0000003"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    files = {p.name for p in (ckpt / "iter_0000003").iterdir()}
    assert {"common.pt", "metadata.json", ".metadata"} <= files
    assert any(f.endswith(".distcp") for f in files)
    # Titan resumes at the rollout after the newest, with the scheduler state
    assert res["resumed_step"] == 4 and res["resumed_has_scheduler"]


def test_common_state_is_what_megatron_lm_reads(run) -> None:
    """common.pt read as Megatron-LM's rank-0 load reads it (torch.load, weights_only=False):
    the top-level keys of its generate_state_dict and the args its load_checkpoint /
    check_checkpoint_args read."""
    root, _, _ = run
    sd = torch.load(root / "ckpt/iter_0000003/common.pt", map_location="cpu", weights_only=False)
    assert sd["iteration"] == 3 and sd["checkpoint_version"] == 3.0
    assert sd["num_floating_point_operations_so_far"] == 0
    assert sd["opt_param_scheduler"]["num_steps"] > 0  # megatron-core's scheduler state
    assert sd["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert sd["common"]["rollout_id"] == 3 and sd["common"]["step"] == 4  # Titan's own
    args = sd["args"]
    assert isinstance(args, argparse.Namespace)
    want = {
        "num_layers": COMMON["num_hidden_layers"],
        "hidden_size": COMMON["hidden_size"],
        "num_attention_heads": COMMON["num_attention_heads"],
        "num_query_groups": COMMON["num_key_value_heads"],
        "group_query_attention": True,
        "ffn_hidden_size": COMMON["intermediate_size"],
        "add_position_embedding": True,  # Megatron-LM's default, rope included
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "swiglu": True,
        "untie_embeddings_and_output_weights": False,  # the llama case ties them
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "world_size": 1,
        "data_parallel_size": 1,
        "no_save_rng": True,  # Megatron-LM then loads no RNG state
        "no_save_optim": False,
        "use_distributed_optimizer": True,
        "ckpt_format": "torch_dist",
        "consumed_train_samples": 0,
    }
    assert {k: getattr(args, k) for k in want} == want
    # read without a default by check_checkpoint_args, or compared when the run sets them
    for name in ("max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size",
                 "tokenizer_type", "data_parallel_random_init", "skipped_train_samples",
                 "consumed_valid_samples", "ckpt_fully_parallel_save"):  # fmt: skip
        assert hasattr(args, name), name
    assert args.padded_vocab_size >= COMMON["vocab_size"]


def test_common_state_loads_with_torch_defaults_in_a_fresh_process(run) -> None:
    """torch.load's default (weights_only=True, as megatron-core's load_common calls it)
    reads Titan's common.pt once titan_core.checkpoint is imported, megatron-core not; a
    release checkpoint written as Megatron-LM writes it (megatron-core's enums in args)
    passes Titan's checks too."""
    root, _, _ = run
    code = (
        "import sys, torch, titan_core.checkpoint as c\n"
        f"sd = torch.load({str(root / 'ckpt/iter_0000003/common.pt')!r})\n"
        "assert 'megatron.core' not in sys.modules\n"
        "assert sd['args'].num_layers == 2\n"
        f"print(c.damage({str(root / 'converted/release')!r}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=ENV,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "None"


def test_release_checkpoint_loads(run) -> None:
    """A release checkpoint laid out as slime's converter lays it out (tracker 'release',
    folder release/, Megatron-LM's common state): found, intact, and its weights loaded
    give the trainer's logits; it is never a resume point (Megatron-LM: weights only)."""
    root, _, res = run
    assert (root / "converted/latest_checkpointed_iteration.txt").read_text() == "release"
    assert res["release_is_release"] and res["release_damage"] is None
    assert torch.equal(res["release_logits"], res["logits"])
    assert res["release_resume"] is None


def test_save_hf_snapshots_load_in_transformers_with_the_trainers_logits(run) -> None:
    """--save-hf: one HF folder per save, at save_hf.format(rollout_id=...), none pruned;
    transformers loads it and gives the trainer's logits (the updated policy, not the model
    the run started from); --hf-checkpoint's other files come along."""
    from transformers import AutoModelForCausalLM

    root, model_dir, res = run
    assert sorted(p.name for p in (root / "hf").iterdir()) == [f"rollout_{i}" for i in range(4)]
    snap = root / "hf/rollout_3"
    assert (snap / "generation_config.json").is_file() == (
        model_dir / "generation_config.json"
    ).is_file()
    model = AutoModelForCausalLM.from_pretrained(snap, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=res["ids"]).logits
    diff = (got - res["logits"]).abs().max().item()
    assert diff < 1e-4, f"the HF snapshot's logits differ from the trainer's by {diff:.3g}"
    start = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        moved = (start(input_ids=res["ids"]).logits - res["logits"]).abs().max().item()
    assert moved > 1e-3, "the snapshot should hold the updated policy"
