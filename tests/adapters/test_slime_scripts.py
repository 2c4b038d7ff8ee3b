"""slime's own launch scripts run on Titan: the argument arrays of ``scripts/run-qwen3-4B.sh``
and ``run-qwen3-30B-A3B.sh`` (../shared/peers/slime-scripts, unchanged) given to
``python -m adapters.slime.train`` with only paths, sizes and counts changed, after the
reference checkpoint is made the way slime's README makes it (its converter's command line,
``python -m adapters.slime.convert_hf_to_torch_dist``). The dense run is started again with
more rollouts and resumes from ``--save``; both train on ``--prompt-data`` through slime's
own data source, scored by slime's ``rm_hub`` (``--rm-type``), evaluated on
``--eval-prompt-data``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adapters.slime_scripts import convert_once, math_prompts, script_argv, tiny_qwen3
from titan_core.training.metrics import read_metrics

pytest.importorskip("slime.ray.placement_group", reason="slime's wheel (../shared/peers) is needed")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRAIN_PROMPTS, EVAL_PROMPTS = 6, 2


def _sizes(root: Path, hf: Path, vocab: int) -> dict[str, str]:
    """What changes in slime's script: paths, model sizes, counts."""
    return {
        "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "96",
        "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
        "--vocab-size": str(vocab), "--hf-checkpoint": str(hf), "--ref-load": str(root / "ref"),
        "--load": str(root / "ckpt"), "--save": str(root / "ckpt"), "--save-interval": "1",
        "--prompt-data": str(math_prompts(root / "dapo.jsonl", TRAIN_PROMPTS)),
        "--num-rollout": "2", "--rollout-batch-size": "2", "--n-samples-per-prompt": "2",
        "--rollout-max-response-len": "8", "--global-batch-size": "4", "--eval-interval": "1",
        "--eval-prompt-data": f"aime {math_prompts(root / 'aime.jsonl', EVAL_PROMPTS, 100)}",
        "--n-samples-per-eval-prompt": "2", "--eval-max-response-len": "8",
        "--max-tokens-per-gpu": "512",
    }  # fmt: skip


def _run(*cmd: str) -> subprocess.CompletedProcess:
    # the script's flags alone: no Titan YAML from the environment (TITAN_CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    proc = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, cwd=REPO,
                          timeout=900, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def _convert(argv: list[str], first_model_flag: str, hf: Path, ref: Path) -> str:
    model = argv[argv.index(first_model_flag) : argv.index("--hf-checkpoint")]
    # the same conversion as test_miles_scripts': run once a session (slime_scripts)
    return convert_once(
        model, hf, ref, lambda args: _run("adapters.slime.convert_hf_to_torch_dist", *args).stdout
    )


def _offset(ckpt: Path, rollout_id: int) -> int:
    """slime's data source position after ``rollout_id`` (its own state file)."""
    import torch

    state = torch.load(ckpt / f"rollout/global_dataset_state_dict_{rollout_id}.pt")
    return int(state["sample_offset"])


def test_run_qwen3_4b_script_trains_and_resumes(tmp_path: Path) -> None:
    hf, vocab = tiny_qwen3(tmp_path / "hf")
    argv = script_argv("run-qwen3-4B.sh", _sizes(tmp_path, hf, vocab), num_gpus=2)
    assert argv.count("--tensor-model-parallel-size") == 1 and "--colocate" in argv
    assert "wrote" in _convert(argv, "--swiglu", hf, tmp_path / "ref")
    run = tmp_path / "run"
    dump = str(tmp_path / "dump" / "{rollout_id}.pt")
    out = _run("adapters.slime.train", *argv, "--metrics-dir", str(run),
               "--save-debug-rollout-data", dump).stdout  # fmt: skip
    assert "rollout    2/2" in out
    # slime's own dump of each rollout's and evaluation's samples
    names = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert names == ["0.pt", "1.pt", "eval_0.pt", "eval_1.pt"], names
    # flags that have no effect on this machine say so, once each, at start-up
    for flag in ("--attention-backend", "--sglang-mem-fraction-static", "--sequence-parallel"):
        assert sum(line.startswith(f"no effect here: {flag}:") for line in out.splitlines()) == 1
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all("eval/aime" in r for r in recs)  # each --eval-interval 1 evaluation, by name
    ckpt = tmp_path / "ckpt"
    # Megatron-LM's layout, numbered by rollout as slime's actor numbers it; none pruned
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (ckpt / "iter_0000000").is_dir() and (ckpt / "iter_0000001").is_dir()
    assert (tmp_path / "ref" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert _offset(ckpt, 1) == 4  # 2 rollouts x 2 prompts of --prompt-data, in slime's order

    # the same command for one epoch of the 6 prompts (3 rollouts) resumes after rollout 2
    # (--load == --save)
    i = argv.index("--num-rollout")
    argv[i : i + 2] = ["--num-epoch", "1"]
    out = _run("adapters.slime.train", *argv, "--metrics-dir", str(run)).stdout
    assert "rollout    3/3" in out and "rollout    1/" not in out and "(before RL)" not in out
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3]
    assert _offset(ckpt, 2) == 6


def test_run_qwen3_30b_a3b_script_runs_moe(tmp_path: Path) -> None:
    hf, vocab = tiny_qwen3(tmp_path / "hf", moe=True)
    sizes = _sizes(tmp_path, hf, vocab) | {
        "--moe-ffn-hidden-size": "32", "--moe-router-topk": "2", "--num-experts": "4",
        "--moe-layer-freq": "[1,1]", "--expert-model-parallel-size": "2",
        "--rollout-num-gpus-per-engine": "2", "--num-rollout": "1",
        # megatron-core refuses MoE with TP > 1 without sequence parallelism in training, and
        # its local layers (no Transformer Engine on CPU) cannot split the sequence: TP 1
        "--tensor-model-parallel-size": "1",
    }  # fmt: skip
    argv = script_argv("run-qwen3-30B-A3B.sh", sizes, num_gpus=2)
    _convert(argv, "--disable-bias-linear", hf, tmp_path / "ref")
    run = tmp_path / "run"
    out = _run("adapters.slime.train", *argv, "--skip-eval-before-train", "--metrics-dir",
               str(run)).stdout  # fmt: skip
    assert "(before RL)" not in out
    assert "rollout    1/1" in out
    for flag in ("--moe-grouped-gemm", "--optimizer-cpu-offload", "--sglang-cuda-graph-bs"):
        assert f"no effect here: {flag}:" in out
    recs = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 1]
    assert recs and "train/pg_loss" in recs[0]
