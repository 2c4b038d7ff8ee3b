"""Colocation frees the device: ``TitanBackend.sleep`` releases the trainer's weights,
gradient buffers, optimizer state and reference model, ``wake_up`` restores them
bit-identical, and training goes on exactly as in a run that never slept; the slime and
miles actors drive it as their frameworks' Megatron actors do."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.models.hf_cases import build_hf_model

REPO = Path(__file__).resolve().parents[2]


def _worker(tmp_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    model_dir = tmp_path / "hf"
    build_hf_model("llama").save_pretrained(model_dir)
    out = tmp_path / "out.pt"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/adapters/colocate_worker.py"),
         "--model-dir", str(model_dir), "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory) -> dict[str, Any]:
    """Both layouts (fp32; bf16 + distributed optimizer + reference model), each as a
    reference run and a sleeping run (one process, ~15 s on 2 cores)."""
    return _worker(tmp_path_factory.mktemp("colocate"), {"TITAN_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("layout", ["fp32", "bf16"])
def test_sleep_releases_and_wake_restores(cpu_runs, layout):
    seen = cpu_runs[layout]["sleep"]["seen"]
    assert seen["n_state"] > 0, "no Adam state after the first step"
    assert seen["has_ref"] == (layout == "bf16")
    before, after = seen["counter_before"], seen["counter_after"]
    assert before > 0
    assert after <= 0.05 * before, (before, after)
    assert seen["sleep"]["memory/device_bytes_before_sleep"] == before
    assert seen["sleep"]["memory/device_bytes_after_sleep"] == after
    assert seen["second_sleep"] == {}  # asleep already: a no-op
    assert "asleep" in seen["train_asleep"] and "wake_up()" in seen["train_asleep"]
    # a weight sync while asleep gets the weights, and they leave again after it
    assert seen["weights_awake_equal"]
    assert 0 < seen["counter_weights_awake"] < before
    assert seen["counter_after_weights"] == after
    # every parameter, DDP buffer and optimizer tensor is back, bit for bit
    assert seen["counter_woken"] == before
    assert any(".grad_data" in k for k in seen["keys"])
    assert any(".exp_avg_sq" in k for k in seen["keys"])
    if layout == "bf16":
        assert any(".param_data" in k for k in seen["keys"])
        assert any(k.startswith("ref0.") for k in seen["keys"])
    assert seen["mismatch"] == []


@pytest.mark.parametrize("layout", ["fp32", "bf16"])
def test_training_after_wake_equals_a_run_that_never_slept(cpu_runs, layout):
    plain, slept = cpu_runs[layout]["plain"], cpu_runs[layout]["sleep"]
    assert slept["second"]["train/loss"] == plain["second"]["train/loss"]
    assert plain["params"].keys() == slept["params"].keys()
    assert all(torch.equal(plain["params"][k], slept["params"][k]) for k in plain["params"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sleep_frees_cuda_memory(tmp_path):
    runs = _worker(tmp_path, {"TITAN_ACCELERATOR": "cuda"})
    for layout in ("fp32", "bf16"):
        seen = runs[layout]["sleep"]["seen"]
        held = seen["counter_before"]
        assert seen["counter_after"] <= 0.05 * held
        # memory_allocated drops by what the trainer held; an engine taking that much
        # while the trainer sleeps peaks no higher than the trainer alone did
        assert seen["allocated_before"] - seen["allocated_after"] >= 0.95 * held, seen
        assert seen["peak_with_engine"] <= seen["allocated_before"] + 0.05 * held, seen
        assert seen["mismatch"] == []
        plain, slept = runs[layout]["plain"], runs[layout]["sleep"]
        assert all(torch.equal(plain["params"][k], slept["params"][k]) for k in plain["params"])


# ---- the pieces: storage offload, accelerator, torch_memory_saver ----------------------------
def test_storage_offload_dedups_views_and_restores_bytes():
    from titan_core.accelerator import accelerator_named
    from titan_core.training.device_memory import StorageOffload, device_storage_bytes

    flat = torch.randn(1000)
    views = [flat[:400].view(20, 20), flat[400:]]  # parameters as views into one buffer
    other = torch.arange(10, dtype=torch.int64)
    parts = {"weights": [*views, flat], "optimizer": [other, views[0]]}
    copies = [t.clone() for t in (flat, other)]
    cpu = torch.device("cpu")
    assert device_storage_bytes(parts, cpu) == 1000 * 4 + 10 * 8  # each storage once
    off = StorageOffload(accelerator_named("cpu"), cpu)
    assert off.offload(parts) == 4080 and off.asleep
    assert device_storage_bytes(parts, cpu) == 0 and flat.untyped_storage().nbytes() == 0
    assert off.offload(parts) == 0  # asleep already
    with off.resident("weights"):
        assert torch.equal(flat, copies[0]) and device_storage_bytes(parts, cpu) == 4000
    assert device_storage_bytes(parts, cpu) == 0
    off.restore()
    assert not off.asleep
    assert torch.equal(flat, copies[0]) and torch.equal(other, copies[1])
    assert torch.equal(views[1], copies[0][400:])  # the views see the restored bytes


def test_host_buffer_and_no_memory_saver_on_cpu():
    from titan_core.accelerator import accelerator_named

    cpu = accelerator_named("cpu")
    buf = cpu.host_buffer(64)
    assert buf.dtype == torch.uint8 and buf.numel() == 64 and not buf.is_pinned()
    assert cpu.memory_saver("titan_train") is None


def test_memory_saver_needs_its_preload_hook(monkeypatch):
    """torch_memory_saver only where its LD_PRELOAD hook is loaded; slime's whole-process
    set-up (TMS_INIT_ENABLE) only with its CPU backup on; calls per its real API."""
    import types

    from titan_core.accelerator import memory_saver as ms

    calls: list[tuple] = []

    class FakeTms:
        @contextmanager
        def region(self, tag: str = "default", enable_cpu_backup: bool = False):
            calls.append(("region", tag, enable_cpu_backup))
            yield

        def pause(self, tag: str | None = None) -> None:
            calls.append(("pause", tag))

        def resume(self, tag: str | None = None) -> None:
            calls.append(("resume", tag))

    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = FakeTms()
    monkeypatch.setitem(sys.modules, "torch_memory_saver", module)
    monkeypatch.setattr(ms.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("TMS_INIT_ENABLE", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    assert ms.find_memory_saver("t") is None  # installed, hook not loaded
    monkeypatch.setenv("LD_PRELOAD", "/x/torch_memory_saver_hook_mode_preload.abi3.so")
    saver = ms.find_memory_saver("t")
    with saver.region():
        pass
    saver.pause()
    saver.resume()
    assert calls == [("region", "t", True), ("pause", "t"), ("resume", "t")]
    monkeypatch.setenv("TMS_INIT_ENABLE", "1")  # slime's: everything already in its region
    assert ms.find_memory_saver("t") is None  # ... but no CPU backup: contents would be lost
    monkeypatch.setenv("TMS_INIT_ENABLE_CPU_BACKUP", "1")
    calls.clear()
    saver = ms.find_memory_saver("t")
    with saver.region():  # no nested region (torch_memory_saver refuses one)
        pass
    saver.pause()
    saver.resume()
    assert calls == [("pause", None), ("resume", None)]


@pytest.mark.skipif(
    importlib.util.find_spec("torch_memory_saver") is None
    or not torch.cuda.is_available()
    or "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""),
    reason="needs CUDA, torch_memory_saver and its hook (LD_PRELOAD=.../torch_memory_saver_"
    "hook_mode_preload*.so)",
)
def test_torch_memory_saver_releases_a_region():
    from titan_core.accelerator import accelerator_named

    cuda = accelerator_named("cuda")
    saver = cuda.memory_saver("titan_test")
    assert saver is not None
    with saver.region():
        x = torch.full((1 << 28,), 7, dtype=torch.uint8, device="cuda")
    cuda.synchronize()
    free = cuda.mem_get_info()[0]
    saver.pause()
    assert cuda.mem_get_info()[0] - free >= 0.9 * x.nbytes
    saver.resume()
    assert bool((x == 7).all())


# ---- the actors' wiring (no Ray, no trainer: a backend that records what it is asked) ------
class FakeBackend:
    """TitanBackend's sleep contract: ``sleep`` / ``wake_up`` idempotent, ``awake`` blocks,
    training only while awake, weight reads with the weights on the device."""

    def __init__(self) -> None:
        self.asleep = False
        self.weights_on = False
        self.calls: list[str] = []

    def sleep(self) -> dict[str, float]:
        if self.asleep:
            return {}
        self.asleep = True
        self.calls.append("sleep")
        return {"memory/device_bytes_before_sleep": 100.0, "memory/device_bytes_after_sleep": 0.0}

    def wake_up(self) -> None:
        if self.asleep:
            self.asleep = False
            self.calls.append("wake_up")

    @contextmanager
    def awake(self, weights_only: bool = False):
        was = self.asleep
        self.calls.append("awake(weights)" if weights_only else "awake")
        if weights_only:
            self.weights_on = True
        else:
            self.asleep = False
        try:
            yield
        finally:
            self.weights_on = False
            self.asleep = was

    def _need(self, weights_only: bool = False) -> None:
        if self.asleep and not (weights_only and self.weights_on):
            raise RuntimeError("asleep")

    def train(self, data: Any) -> dict[str, float]:
        self._need()
        self.calls.append("train")
        return {"train/loss": 1.0}

    def save(self, rollout_id: int) -> None:
        self._need()
        self.calls.append("save")

    def save_hf(self, path: Any) -> None:
        self._need(weights_only=True)
        self.calls.append("save_hf")

    def parallel_config(self) -> dict[str, int]:
        return {"dp_rank": 0, "dp_size": 1}


def test_slime_actor_sleeps_as_slimes_megatron_actor(monkeypatch, tmp_path):
    pytest.importorskip("slime.ray.train_actor", reason="slime's wheel (../shared/peers) is needed")
    from adapters.slime.actor import TitanTrainActor

    data_mod = pytest.importorskip("slime.utils.data")
    monkeypatch.setattr(data_mod, "process_rollout_data", lambda args, ref, r, n: {"ref": ref})
    actor = object.__new__(TitanTrainActor)  # the contract's methods, without Ray
    actor.backend, actor.metrics, actor.weight_version = FakeBackend(), {}, 0
    actor.args = SimpleNamespace(
        offload_train=True, update_weight_transport="disk", update_weight_disk_dir=str(tmp_path)
    )
    b = actor.backend

    figures = actor.sleep()  # slime's RayTrainGroup.offload()
    assert figures["memory/device_bytes_after_sleep"] == 0.0 and b.asleep
    assert actor.sleep() == {}  # asleep already
    metrics = actor.train(0, "ref")  # wakes, trains, sleeps again under --offload-train
    assert b.asleep and b.calls == ["sleep", "wake_up", "train", "sleep"]
    assert metrics["train/loss"] == 1.0 and "memory/device_bytes_before_sleep" in metrics
    actor.update_weights()  # asleep: the weights alone come back for the export
    actor.save_model(0)  # asleep: everything back for the checkpoint
    assert b.calls[4:] == ["awake(weights)", "save_hf", "awake", "save"] and b.asleep
    actor.wake_up()  # slime's RayTrainGroup.onload()
    actor.wake_up()
    assert not b.asleep and b.calls[-1] == "wake_up"


def test_miles_actor_sleep_and_wake(monkeypatch):
    pytest.importorskip("miles.ray.train_actor", reason="miles' wheel (../shared/peers) is needed")
    from adapters.miles.actor import TitanTrainRayActor

    actor = object.__new__(TitanTrainRayActor)
    actor.backend, actor.metrics = FakeBackend(), {}
    actor.args = SimpleNamespace(save_hf=None)
    actor._heartbeat = SimpleNamespace(bump=lambda: None)
    b = actor.backend
    actor.sleep()  # miles' RayTrainGroup.offload()
    actor.sleep()
    assert actor.get_metrics()["memory/device_bytes_after_sleep"] == 0.0
    actor.save_model(3)
    assert b.calls == ["sleep", "awake", "save"] and b.asleep
    actor.wake_up()  # miles' RayTrainGroup.onload()
    assert not b.asleep
