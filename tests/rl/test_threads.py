"""The trainer's and engines' threads: ``trainer.num_threads`` / ``engines.num_threads``, the
``OMP_NUM_THREADS`` default, the auto split the placement plan makes (colocated, disaggregated,
async), the wait policy given to the processes, and what --dry-run prints; end to end, the
trainer actor and the engine report the counts the plan resolved (in a run with neither
evaluation nor checkpoints, ``run.eval_interval=null run.save_interval=null``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_core.config import ConfigError, load_config
from titan_core.training.metrics import read_metrics
from titan_rl.actors.server import build_command
from titan_rl.config import GRPOConfig
from titan_rl.grpo import main, resolve_config
from titan_rl.placement import SPIN_COUNT, plan_placement, resolve_threads

REPO = Path(__file__).resolve().parents[2]
MATH = REPO / "examples/math.yaml"
OPENMP_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@pytest.fixture
def cores(monkeypatch):
    """This process may use ``n`` cores, and the environment sets no OpenMP variable."""

    def use(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    for name in OPENMP_ENV:
        monkeypatch.delenv(name, raising=False)
    return use


def _plan(*overrides: str):
    cfg = resolve_config(load_config(GRPOConfig, MATH, list(overrides)))
    return plan_placement(cfg, "cpu", None, None)


@pytest.mark.parametrize(
    "override, key",
    [("trainer.num_threads=0", "trainer.num_threads"), ("engines.num_threads=0", "engines.num_threads"),
     ("trainer.num_threads=two", "trainer.num_threads")],
)  # fmt: skip
def test_thread_keys_are_checked(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(GRPOConfig, MATH, [override])


def test_auto_splits_the_cores_between_trainer_and_engines_computing_at_once(cores):
    cores(8)
    t = _plan("rollout.async=true").threads  # disaggregated: 1 trainer process and 1 engine
    assert (t.trainer, t.engine, t.trainer_from, t.engine_from) == (4, 4, "auto", "auto")
    assert t.at_once and not t.trainer_alone and t.spin_count == SPIN_COUNT == 30_000
    # a sync rollout (the default): the trainer trains while the engines wait, on every core
    t = _plan().threads
    assert (t.trainer, t.engine, t.at_once, t.trainer_alone) == (8, 4, True, True)
    # colocated, each phase has every core
    t = _plan("engines.colocate=true").threads
    assert (t.trainer, t.engine, t.at_once) == (8, 8, False)
    # 2 trainer processes and an engine of 2 TP ranks: 4 slots of 2 cores each
    t = _plan(
        "trainer.num_processes=2", "engines.tp_size=2", "train.micro_batch_size=64",
        "rollout.async=true",
    ).threads  # fmt: skip
    assert (t.trainer, t.engine) == (2, 4)
    # 3 slots of 8 cores: 2 each, the 2 left over to the trainer processes
    t = _plan("trainer.num_processes=2", "train.micro_batch_size=64", "rollout.async=true").threads
    assert (t.trainer, t.engine) == (3, 2)
    t = _plan("trainer.num_processes=2", "train.micro_batch_size=64").threads  # sync
    assert (t.trainer, t.engine) == (4, 2)
    cores(2)
    t = _plan("trainer.num_processes=4", "train.micro_batch_size=64").threads
    assert (t.trainer, t.engine) == (1, 1)  # more processes than cores: one thread each
    assert (_plan("engines.colocate=true").threads.trainer, _plan().threads.trainer) == (2, 2)
    assert _plan("rollout.async=true").threads.trainer == 1


def test_omp_num_threads_is_the_default_of_both_and_the_keys_win(cores, monkeypatch):
    cores(8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    t = _plan().threads
    assert (t.trainer, t.engine, t.trainer_from, t.engine_from) == (3, 3, *["OMP_NUM_THREADS"] * 2)
    t = _plan("trainer.num_threads=5", "engines.num_threads=2").threads
    assert (t.trainer, t.engine, t.trainer_from) == (5, 2, "trainer.num_threads")
    assert _plan("engines.num_threads=6").threads.trainer == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # nested levels: the first is this process's
    assert _plan().threads.trainer == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS='lots'"):
        _plan()


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "1000")])
def test_the_users_openmp_wait_is_left_alone(cores, monkeypatch, name, value):
    cores(2)
    assert _plan().threads.env(1) == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "30000"}
    monkeypatch.setenv(name, value)
    t = _plan().threads
    assert t.spin_count is None and t.env(1) == {"OMP_NUM_THREADS": "1"}
    assert "the user's OMP_WAIT_POLICY / GOMP_SPINCOUNT" in t.describe()


def test_the_engine_launch_carries_the_resolved_threads(cores):
    cores(8)
    launch = _plan("engines.colocate=true").engine
    assert launch.num_threads == 8
    assert launch.env == {"OMP_NUM_THREADS": "8", "GOMP_SPINCOUNT": "30000"}
    cmd = build_command(launch, 30000)
    assert cmd[cmd.index("--num-threads") + 1] == "8"
    # SGLang's processes keep their own environment (the key is the built-in engine's)
    cfg = resolve_config(load_config(GRPOConfig, MATH, ["engines.backend=sglang"]))
    assert plan_placement(cfg, "cuda", "GPU", 2).engine.env == {}


def test_resolve_threads_is_the_adapters_rule_too():
    """The slime / miles adapters call it with the framework's layout (no GRPO config)."""
    t = resolve_threads(None, None, 2, 1, 2, at_once=True, cores=16, environ={})
    assert (t.trainer, t.engine) == (4, 8)
    t = resolve_threads(None, 3, 2, 1, 2, at_once=False, cores=16, environ={})
    assert (t.trainer, t.engine, t.engine_from) == (8, 3, "engines.num_threads")


def test_dry_run_prints_the_threads(cores, capsys):
    cores(2)
    assert main(["--config", str(MATH), "--dry-run", "trainer.num_threads=2"]) == 0
    out = capsys.readouterr().out
    assert (
        "threads: 2 per trainer process (trainer.num_threads), 1 per engine (auto); auto: the 2 "
        "core(s) this job may use, split between the trainer processes and the engines (side "
        "by side), the trainer's all of them (it trains while the engines wait); "
        "GOMP_SPINCOUNT=30000 (idle threads spin ~0.4 ms, then sleep)"
    ) in out.splitlines()
    assert main(["--config", str(MATH), "--dry-run", "engines.colocate=true"]) == 0
    assert "2 per engine (auto); auto: the 2 core(s) this job may use, for each phase" in (
        capsys.readouterr().out
    )


def test_a_local_ray_runs_its_workers_at_niceness_0_and_prestarts_none(monkeypatch):
    from titan_rl.config import RayConfig
    from titan_rl.placement import NICENESS_ENV, PRESTART_ENV, placement_plan, ray_init_kwargs

    cfg = load_config(GRPOConfig, MATH, [])
    plan = _plan()
    monkeypatch.delenv(NICENESS_ENV, raising=False)
    monkeypatch.delenv(PRESTART_ENV, raising=False)
    assert ray_init_kwargs(RayConfig(), plan)["_system_config"] == {
        "worker_niceness": 0, "prestart_worker_first_driver": False,
    }  # fmt: skip
    assert "ray: local, workers at niceness 0 (Ray's default: 15)" in placement_plan(cfg)
    monkeypatch.setenv(NICENESS_ENV, "10")  # the user's stands
    assert ray_init_kwargs(RayConfig(), plan)["_system_config"] == {
        "prestart_worker_first_driver": False
    }
    assert "ray: local, workers at niceness 10 (RAY_worker_niceness)" in placement_plan(cfg)
    monkeypatch.setenv(PRESTART_ENV, "1")  # so does this one
    assert "_system_config" not in ray_init_kwargs(RayConfig(), plan)
    # joining a cluster: its own settings (Ray refuses system settings there)
    assert "_system_config" not in ray_init_kwargs(RayConfig(address="auto"), plan)


def test_a_bad_omp_num_threads_exits_2(cores, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    assert main(["--config", str(MATH), "--dry-run"]) == 2
    assert "OMP_NUM_THREADS='0': give a positive number of threads" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_without_eval_or_checkpoints_runs_the_resolved_threads(tmp_path, base):
    """The trainer actor and the engine process report the threads the plan resolved
    (``trainer.num_threads``, and ``OMP_NUM_THREADS`` as the engine's default), each with
    the short OpenMP spin, at niceness 0 (not Ray's 15); with ``run.eval_interval=null run.save_interval=null`` the run
    writes no eval/accuracy and no checkpoint, not even at its last step."""
    run_dir = tmp_path / "run"
    dropped = ("TITAN_CONFIG", "RAY_worker_niceness", *OPENMP_ENV)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    proc = subprocess.run(
        [sys.executable, "-m", "titan_rl.grpo", "--config", str(MATH), f"policy.load={base}",
         f"run.dir={run_dir}", "run.num_steps=2", "run.eval_interval=null",
         "run.save_interval=null", "rollout.prompts_per_step=16", "train.micro_batch_size=64",
         "train.ppo_steps=1", "sync.check_every=0", "trainer.num_threads=2"],
        capture_output=True, text=True, cwd=REPO, timeout=900,
        env=env | {"OMP_NUM_THREADS": "3"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    said = proc.stdout + proc.stderr
    line = (
        "trainer rank 0: 2 torch threads (GOMP_SPINCOUNT=30000, OMP_WAIT_POLICY=unset, niceness 0)"
    )
    assert line in said, said[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    line = (
        "titan_rl.engine: 3 torch threads per TP rank (GOMP_SPINCOUNT=30000, "
        "OMP_WAIT_POLICY=unset, niceness 0)"
    )
    assert line in logs, logs[-3000:]
    recs = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    assert not any("eval/accuracy" in r for r in recs)
    assert not (run_dir / "checkpoints").exists()
    assert (run_dir / "reward.png").is_file()
