"""miles' own launch scripts run on Titan, as a miles user would switch: ``run_qwen3_4b.py``
and ``run_qwen3_30b_a3b.py`` (../shared/peers/miles-scripts, unchanged) build their command
line in their default mode; it goes to ``python -m adapters.miles.train`` instead of miles'
``train.py``, with only paths, sizes and counts changed (``tests/adapters/miles_scripts.py``).

Size changes, and why they are fair: the models are tiny random Qwen3 / Qwen3-MoE
(``slime_scripts.tiny_qwen3``) with the scripts' model flags at those sizes; the layouts are
scaled to the 2 trainer ranks a 2-core machine runs, and the engines to one built-in CPU
engine of 2 devices (one process whatever its size; no router: a short run).

- run_qwen3_4b.py trains TP=2 x CP=4 on 8 GPUs, engines of 1 GPU: here TP=2 x CP=1 on 2
  ranks. The TP split is the script's; with CP=4 it would need 8 ranks, so
  ``--context-parallel-size`` and ``--actor-num-gpus-per-node`` are the sizes changed
  (``--cp-comm-type a2a`` stays, named as having no effect; ``--sequence-parallel`` too, as
  megatron-core's local layers on a CPU cannot split the sequence).
- run_qwen3_30b_a3b.py trains TP=4, EP=8 on 8 GPUs, engines of 8: here EP=2 over the 2
  ranks (the script's EP spans all its ranks; each rank holds 2 of the 4 experts) and TP=1:
  megatron-core trains MoE layers under TP > 1 only with sequence parallelism, which its
  local layers (no Transformer Engine on a CPU) cannot run.

Counts: 2 prompts x 2 samples per rollout, 8-token responses, one sample per eval prompt.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("miles.ray.train_actor", reason="miles' wheel (../shared/peers) is needed")

from tests.adapters.miles_scripts import change, model_args, script_launch, train_argv  # noqa: E402
from tests.adapters.slime_scripts import convert_once, math_prompts, tiny_qwen3  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DENSE, MOE = "run_qwen3_4b.py", "run_qwen3_30b_a3b.py"
MODEL_NAME = {DENSE: "Qwen3-4B", MOE: "Qwen3-30B-A3B"}

#: the tiny models' sizes in Megatron's flags (slime_scripts.TINY)
TINY_FLAGS = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "96",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
}  # fmt: skip
TINY_MOE_FLAGS = {
    "--moe-ffn-hidden-size": "32", "--moe-router-topk": "2", "--num-experts": "4",
    "--moe-layer-freq": "[1,1]",
}  # fmt: skip
COUNTS = {
    "--rollout-batch-size": "2", "--n-samples-per-prompt": "2", "--global-batch-size": "4",
    "--rollout-max-response-len": "8", "--n-samples-per-eval-prompt": "1",
    "--eval-max-response-len": "8",
}  # fmt: skip
LAYOUT = {
    DENSE: {"--context-parallel-size": "1", "--actor-num-gpus-per-node": "2",
            "--rollout-num-gpus-per-engine": "2"},
    MOE: {"--tensor-model-parallel-size": "1", "--expert-model-parallel-size": "2",
          "--rollout-num-gpus-per-engine": "2"},
}  # fmt: skip


def _launch(script: str, root: Path, num_gpus_per_node: int | None = 2) -> Any:
    """The script's own command line for nodes of ``num_gpus_per_node`` devices (None: its
    hardware's, 8 on an H100 node), paths under ``root``."""
    return script_launch(
        script, num_gpus_per_node=num_gpus_per_node, model_dir=str(root / "models"),
        data_dir=str(root / "datasets"), output_dir=str(root / "out"), run_id="run",
    )  # fmt: skip


def _env(launch: Any) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **launch.env)
    env.pop("WANDB_API_KEY", None)  # the scripts' default: no wandb flags without a key
    env.pop("TITAN_CONFIG", None)  # the script's flags alone, no Titan YAML from outside
    return env


def _prepare(script: str, root: Path) -> tuple[Any, dict[str, str]]:
    """What the script's ``prepare()`` downloads and converts, made locally: the tiny HF
    model at ``<model_dir>/<model>``, dapo-style and aime-style prompts at the script's
    paths, and ``<model_dir>/<model>_torch_dist`` by ``adapters.slime.convert_hf_to_torch_dist``
    (miles' ``convert_checkpoint`` runs slime's converter with the model args the same way).
    Returns (the launch, the model flags at the tiny sizes)."""
    launch = _launch(script, root)
    hf = root / "models" / MODEL_NAME[script]
    _, vocab = tiny_qwen3(hf, moe=script == MOE)
    data = root / "datasets"
    (data / "dapo-math-17k").mkdir(parents=True)
    (data / "aime-2024").mkdir(parents=True)
    math_prompts(data / "dapo-math-17k" / "dapo-math-17k.jsonl", 16)
    math_prompts(data / "aime-2024" / "aime-2024.jsonl", 2, start=100)
    sizes = {**TINY_FLAGS, "--vocab-size": str(vocab), **(TINY_MOE_FLAGS if script == MOE else {})}
    conv = change(model_args(launch.megatron_model_type), sizes)

    def run(args: list[str]) -> str:
        cmd = [sys.executable, "-m", "adapters.slime.convert_hf_to_torch_dist", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(launch))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.stdout

    # the same conversion as test_slime_scripts': run once a session (slime_scripts)
    convert_once(conv, hf, hf.parent / f"{hf.name}_torch_dist", run)
    return launch, sizes


def _train(launch: Any, changes: dict[str, str], run: Path) -> subprocess.CompletedProcess:
    argv = train_argv(launch, changes)
    cmd = [sys.executable, "-m", "adapters.miles.train", *argv, "--metrics-dir", str(run)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, env=_env(launch), timeout=600
    )
    assert proc.returncode == 0, shlex.join(argv) + proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---- the command lines ---------------------------------------------------------------------------
@pytest.mark.parametrize("script", [DENSE, MOE])
def test_script_command_line_parses_unchanged(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each script's default command line for its 8-GPU node, not a value changed, is
    accepted: every flag honoured or named as having no effect here; miles' derivations
    made (fault tolerance's ``rollout`` component, the ``--dump-details`` paths)."""
    from adapters.miles.arguments import parse_args

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    launch = _launch(script, tmp_path, num_gpus_per_node=None)
    args = parse_args(train_argv(launch, {}))
    assert args.use_fault_tolerance and args.ft_components == ["rollout"]
    dump = str((tmp_path / "out" / "run" / "dump_details").resolve())
    assert args.save_debug_rollout_data == f"{dump}/rollout_data/{{rollout_id}}.pt"
    assert args.save_debug_train_data == f"{dump}/train_data/{{rollout_id}}_{{rank}}.pt"
    named = {line.split(":", 1)[0] for line in args.titan_no_effect}
    assert {"--use-dynamic-batch-size", "--attention-backend"} <= named
    assert "--use-fault-tolerance" not in named and "--dump-details" not in named


def test_fault_tolerance_components(capsys: pytest.CaptureFixture) -> None:
    """``--use-fault-tolerance`` alone is miles' ``rollout`` component; ``--ft-components
    train`` (miles' fault-tolerant trainer cells) exits 2 naming it; without the switch no
    component is on."""
    from adapters.miles.arguments import parse_args

    base = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--rm-type", "math"]  # fmt: skip
    assert parse_args(base).ft_components == []
    assert parse_args([*base, "--use-fault-tolerance"]).ft_components == ["rollout"]
    with pytest.raises(SystemExit) as e:
        parse_args([*base, "--use-fault-tolerance", "--ft-components", "rollout", "train"])
    assert e.value.code == 2 and "--ft-components" in capsys.readouterr().err


def test_train_memory_margin_bytes_sets_the_savers_margin() -> None:
    """``--train-memory-margin-bytes`` under ``--offload-train`` goes to torch_memory_saver's
    ``memory_margin_bytes`` where it offloads the trainer (as miles' actor sets it); without
    torch_memory_saver (host copies) there is no margin to set."""
    from adapters.miles.actor import _set_memory_margin

    tms = SimpleNamespace(memory_margin_bytes=0)
    backend = SimpleNamespace(memory=SimpleNamespace(saver=SimpleNamespace(tms=tms)))
    args = SimpleNamespace(train_memory_margin_bytes=3221225472, offload_train=True)
    _set_memory_margin(args, backend)
    assert tms.memory_margin_bytes == 3221225472
    _set_memory_margin(args, SimpleNamespace(memory=SimpleNamespace(saver=None)))  # no-op


def test_recover_updatable_engines_marks_restarted_engines_new() -> None:
    """``--use-fault-tolerance``: an engine restarted by its supervisor since the last
    weight update is reported new (the update reconnects and resends the weights); one
    whose supervisor gave up is an error naming it."""
    from adapters.miles.rollout import TitanRolloutManager

    group = SimpleNamespace(count=0, lost=[])
    group.restarts = lambda: group.count
    group.gave_up = lambda: group.lost
    manager = SimpleNamespace(engine_group=group, restarts_seen=0, has_new_engines=False)
    TitanRolloutManager.recover_updatable_engines(manager)
    assert manager.has_new_engines is False
    group.count = 1
    TitanRolloutManager.recover_updatable_engines(manager)
    assert manager.has_new_engines is True and manager.restarts_seen == 1
    manager.has_new_engines = False  # the update cleared it
    TitanRolloutManager.recover_updatable_engines(manager)
    assert manager.has_new_engines is False
    group.lost = ["http://127.0.0.1:1"]
    with pytest.raises(RuntimeError, match="127.0.0.1:1"):
        TitanRolloutManager.recover_updatable_engines(manager)


# ---- the runs -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_dense_script_runs_and_resumes(tmp_path: Path) -> None:
    """run_qwen3_4b.py's default mode on Titan (KL loss against --ref-load, colocated
    engines, --use-fault-tolerance, --dump-details, eval on the aime set), 2 rollouts; then
    the same command with --num-rollout 3 resumes from --save and runs rollout 3 only."""
    launch, sizes = _prepare(DENSE, tmp_path)
    run = tmp_path / "run"
    first = _train(launch, {**sizes, **COUNTS, **LAYOUT[DENSE], "--num-rollout": "2"}, run)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/aime" in rows[0] and "(before RL)" in first.stdout
    for r in rows[1:]:
        assert r["train/steps"] == 1.0 and 0.0 <= r["reward/mean"] <= 1.0
    save = tmp_path / "out" / "run" / "checkpoints"
    tracker = save / "latest_checkpointed_iteration.txt"
    saved = int(tracker.read_text())
    dump = tmp_path / "out" / "run" / "dump_details"
    for name in ("rollout_data/eval_0.pt", "rollout_data/0.pt", "rollout_data/1.pt",
                 "train_data/0_0.pt", "train_data/1_1.pt", "tokenizer/tokenizer.json"):  # fmt: skip
        assert (dump / name).is_file(), name
    dumped = (dump / "rollout_data" / "1.pt").stat().st_mtime_ns

    second = _train(launch, {**sizes, **COUNTS, **LAYOUT[DENSE], "--num-rollout": "3"}, run)
    resumed = _rows(run)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert resumed[:3] == rows  # the first run's records kept, not rerun
    assert "(before RL)" not in second.stdout and "rollout    3/3" in second.stdout
    assert "rollout    1/3" not in second.stdout
    assert (dump / "rollout_data" / "1.pt").stat().st_mtime_ns == dumped
    assert (dump / "rollout_data" / "2.pt").is_file()
    assert int(tracker.read_text()) == saved + 1  # one rollout more, saved after it


@pytest.mark.slow
def test_moe_script_runs(tmp_path: Path) -> None:
    """run_qwen3_30b_a3b.py's default mode on Titan with a tiny Qwen3-MoE (alltoall
    dispatcher, EP=2 over 2 ranks, the CPU-Adam offload flags), 2 rollouts."""
    launch, sizes = _prepare(MOE, tmp_path)
    run = tmp_path / "run"
    _train(launch, {**sizes, **COUNTS, **LAYOUT[MOE], "--num-rollout": "2"}, run)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["train/steps"] == 1.0 and 0.0 <= r["reward/mean"] <= 1.0
    assert (
        tmp_path / "out" / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
    ).is_file()


def test_trainer_ranks_get_miles_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variable miles' actor_factory sets for a trainer rank (read from its source)
    is in the environment Titan's ranks get, with miles' defaults."""
    import ast

    from adapters.miles.arguments import parse_args
    from adapters.miles.train import train_env
    from adapters.peers import peer_source

    tree = ast.parse(peer_source("miles.ray.train.actor_factory").read_text())
    fn = next(n for n in ast.walk(tree)
              if isinstance(n, ast.FunctionDef) and n.name == "allocate_gpus_for_actor")  # fmt: skip
    keys = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id == "env_vars":
                keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "env_vars":
                keys.add(ast.literal_eval(target.slice))
    # torch_memory_saver's preload comes with the offload (absent here: no CUDA); miles'
    # dumper (--dumper-source-patcher-config-train) is refused
    preload = {"LD_PRELOAD", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP",
               "TMS_INIT_ENABLE_DISK_BACKUP", "TMS_DISK_BACKUP_CHUNK_MB", "TMS_DISK_BACKUP_DIR",
               "DUMPER_SOURCE_PATCHER_CONFIG"}  # fmt: skip
    assert {"NCCL_CUMEM_ENABLE", "NVSHMEM_DISABLE_NCCL"} <= keys
    args = parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--rm-type", "math",
                       "--train-env-vars", '{"MY_VAR": "x"}'])  # fmt: skip
    env = train_env(args)
    assert keys - preload <= set(env), sorted(keys - preload - set(env))
    assert env["NCCL_CUMEM_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NCCL"] == "1"
    assert env["MY_VAR"] == "x"


def test_ft_trainer_is_refused_in_both_drivers(monkeypatch: pytest.MonkeyPatch) -> None:
    """MILES_EXPERIMENTAL_FT_TRAINER: Titan's driver refuses it before anything starts, and
    miles' own driver, whose v2 group would build miles' Megatron ranks inside Titan's
    actor block, is refused there too."""
    from adapters.miles.train import main as miles_main
    from adapters.miles.train import titan_train_actors
    from titan_core.config import ConfigError

    monkeypatch.setenv("MILES_EXPERIMENTAL_FT_TRAINER", "1")
    assert miles_main(["--rollout-batch-size", "2", "--num-rollout", "1", "--rm-type", "math"]) == 2
    with pytest.raises(ConfigError, match="MILES_EXPERIMENTAL_FT_TRAINER"), titan_train_actors():
        pass
