"""The GRPO job's start-up: what runs side by side, and what its processes leave unimported.

On a 2-core machine the driver, Ray's processes, the trainer and the engine compete for the
cores, so the start-up counts the work done, not only its order: the prompts and the tokenizer
are made while Ray starts (its processes leave a core to spare), and modules the driver and
the engine never use are not imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import titan_rl.job as job_module
from titan_core.config import load_config
from titan_core.signals import StopSignals
from titan_rl.config import GRPOConfig
from titan_rl.data import DatasetError
from titan_rl.job import Job
from titan_rl.step_timer import StartupTimer

REPO = Path(__file__).resolve().parents[2]


class _Reached(Exception):
    """Job.start went past Ray's start (the placement group is next)."""


def _cfg(tmp_path: Path, *overrides: str) -> GRPOConfig:
    return load_config(
        GRPOConfig, REPO / "examples/math.yaml", [f"run.dir={tmp_path / 'run'}", *overrides]
    )


def _start(monkeypatch: pytest.MonkeyPatch, cfg: GRPOConfig, *, fails: bool) -> dict[str, Any]:
    """Job.start with Ray's start, its shutdown and the prompts recorded (nothing is started):
    the prompts wait until Ray's start has begun, so a start that made them first would hang."""
    seen: dict[str, Any] = {"shutdown": 0}
    ray_started = threading.Event()

    def init_ray(**kwargs: Any) -> None:
        seen["ray"] = threading.current_thread().name
        ray_started.set()

    def rollouts(cfg: GRPOConfig) -> object:
        assert ray_started.wait(10), "the prompts were made before Ray's start began"
        seen["rollouts"] = threading.current_thread().name
        if fails:
            raise DatasetError("data.path x is not a file; check the path")
        return object()

    def shutdown() -> None:
        seen["shutdown"] += 1

    def reserve(plan: Any) -> None:
        raise _Reached

    monkeypatch.setattr(job_module, "init_ray", init_ray)
    monkeypatch.setattr(job_module, "Rollouts", rollouts)
    monkeypatch.setattr(job_module.ray, "shutdown", shutdown)
    monkeypatch.setattr(job_module.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(job_module, "reserve", reserve)
    timer = StartupTimer()
    with pytest.raises(DatasetError if fails else _Reached):
        Job.start(cfg, StopSignals(), timer)
    seen["phases"] = list(timer.phases)
    return seen


def test_the_prompts_are_made_while_ray_starts(tmp_path, monkeypatch):
    """A ready base (an HF policy: nothing to pretrain): the prompts are made on a thread
    while Ray starts on the main one; the phases say Ray's start, then the prompts' rest."""
    seen = _start(monkeypatch, _cfg(tmp_path, "policy.format=hf"), fails=False)
    assert seen["ray"] == threading.main_thread().name != seen["rollouts"]
    assert seen["phases"] == ["imports", "ray", "prepare"] and seen["shutdown"] == 0


def test_a_dataset_error_found_while_ray_starts_shuts_ray_down(tmp_path, monkeypatch):
    seen = _start(monkeypatch, _cfg(tmp_path, "policy.format=hf"), fails=True)
    assert "ray" in seen and seen["shutdown"] == 1


def test_a_base_to_pretrain_checks_the_dataset_before_ray(tmp_path, monkeypatch):
    """A Titan policy missing, with policy.pretrain_config: a dataset error must stop the run
    before any pretraining, so the prompts are made first, and Ray never starts for it."""
    started: list[str] = []
    monkeypatch.setattr(job_module, "init_ray", lambda **kwargs: started.append("ray"))
    data = f"data.path={tmp_path / 'missing.jsonl'}"
    cfg = _cfg(tmp_path, "data.type=jsonl", data, f"policy.load={tmp_path / 'b/checkpoints'}")
    with pytest.raises(DatasetError, match="is not a file"):
        Job.start(cfg, StopSignals(), StartupTimer())
    assert started == [] and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "modules",
    [
        "titan_rl.grpo, titan_rl.job, titan_rl.driver",  # the driver's, up to its first step
        "titan_rl.engine.cli, titan_core.models.hf.families",  # the engine's, before its model
    ],
)
def test_start_up_leaves_torch_distributed_checkpoint_unimported(modules):
    """torch.distributed.checkpoint (DTensor, sympy: most of a second of a core) is for the
    trainer's saves and loads; the driver and the engine process never need it."""
    code = f"import sys, {modules}; print('torch.distributed.checkpoint' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env=env
    )
    assert out.stdout.split() == ["False"]


def test_the_collector_is_paused_for_a_start_up_and_on_again_after_it():
    """``paused`` / ``settle``: off in the start-up, then one collection (garbage made in
    it is freed, not frozen), what lives frozen, the collector on; a start-up that fails
    before settling leaves it on."""
    import gc
    import weakref

    from titan_core import startup_gc

    class Node:
        pass

    try:
        with startup_gc.paused():
            assert not gc.isenabled()
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle only the collector frees
            gone = weakref.ref(a)
            del a, b
            kept = [Node()]
            startup_gc.settle()
            assert gc.isenabled()
            assert gone() is None  # collected, not frozen with the rest
            assert gc.get_freeze_count() > 0 and gc.is_tracked(kept)
        with pytest.raises(RuntimeError), startup_gc.paused():
            raise RuntimeError("a start-up that fails")
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_what_the_imports_made_is_frozen_uncollected_and_the_rest_collected_at_settle():
    """``imported``: the objects so far move into the permanent generation without a
    collection (the imports' cyclic garbage stays, the collector stays off); ``settle``
    then collects only what came after and freezes what lives."""
    import gc
    import weakref

    from titan_core import startup_gc

    class Node:
        pass

    def cycle() -> weakref.ref:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle only the collector frees
        return weakref.ref(a)

    try:
        with startup_gc.paused():
            from_imports = cycle()
            frozen = gc.get_freeze_count()
            startup_gc.imported()
            assert not gc.isenabled() and gc.get_freeze_count() > frozen
            from_build = cycle()
            startup_gc.settle()
            assert gc.isenabled()
            assert from_build() is None  # the build's garbage: collected
            assert from_imports() is not None  # the imports': frozen with them
            gc.unfreeze()
            gc.collect()
            assert from_imports() is None  # a full collection would have freed it
    finally:
        gc.unfreeze()
        gc.enable()


def test_shutdown_local_ray_stops_every_process_of_the_job_s_ray():
    """The job's own Ray stops without ``ray.shutdown``'s 1 s wait on the autoscaler
    monitor (SIGKILLed first), and leaves none of its processes behind."""
    import psutil
    import ray

    from titan_rl.placement import init_ray, shutdown_local_ray

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    init_ray(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        started = [p for p in me.children(recursive=True) if p.pid not in before]
        names = [" ".join(p.cmdline()) for p in started]
        assert any("autoscaler/_private/monitor.py" in n for n in names), names
    finally:
        shutdown_local_ray()
    assert not ray.is_initialized()
    gone, alive = psutil.wait_procs(started, timeout=10)
    assert alive == []
