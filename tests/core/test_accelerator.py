"""Accelerator selection: env override, priority order, and a fake MUSA backend."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from titan_core.accelerator import (
    AcceleratorError,
    get_accelerator,
    register_accelerator,
    registered_accelerators,
    reset_accelerator,
    select_accelerator_name,
)
from titan_core.accelerator.cpu import CpuAccelerator
from titan_core.accelerator.musa import MusaAccelerator
from titan_core.accelerator.registry import _REGISTRY


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    saved = dict(_REGISTRY)
    for var in (
        "TITAN_ACCELERATOR",
        "SLIME_ACCELERATOR",
        "MUSA_VISIBLE_DEVICES",
        "MUSA_PATCH_PATH",
    ):
        monkeypatch.delenv(var, raising=False)
    reset_accelerator()
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)
    reset_accelerator()


@pytest.fixture
def fake_musa(monkeypatch):
    """A stand-in ``torch.musa`` with one device, as slime's accelerator tests use."""
    calls: list[str] = []
    musa = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        set_device=lambda i: calls.append(f"set_device({i})"),
        synchronize=lambda device=None: calls.append("synchronize"),
        empty_cache=lambda: calls.append("empty_cache"),
        mem_get_info=lambda device=None: (3, 8),
        memory_allocated=lambda device=None: 5,
        memory_reserved=lambda device=None: 6,
        max_memory_allocated=lambda device=None: 7,
        manual_seed=lambda s: calls.append(f"manual_seed({s})"),
        manual_seed_all=lambda s: calls.append(f"manual_seed_all({s})"),
    )
    monkeypatch.setattr(torch, "musa", musa, raising=False)
    return calls


def test_cpu_is_selected_without_devices():
    assert select_accelerator_name() == "cpu"
    accel = get_accelerator()
    assert accel.name == "cpu" and accel.communication_backend() == "gloo"
    assert accel.device() == torch.device("cpu")


def test_builtin_priorities():
    assert registered_accelerators() == {"musa": 200, "cuda": 100, "cpu": 0}


def test_ray_resource_of_each_kind():
    """Placement bundles hold one Ray "GPU" per device on cuda and musa, CPU only on cpu."""
    from titan_core.accelerator.cuda import CudaAccelerator

    assert CudaAccelerator.ray_resource == MusaAccelerator.ray_resource == "GPU"
    assert CpuAccelerator.ray_resource is None


def test_env_override(monkeypatch):
    monkeypatch.setenv("TITAN_ACCELERATOR", "cpu")
    assert select_accelerator_name() == "cpu"
    monkeypatch.setenv("TITAN_ACCELERATOR", "tpu")
    with pytest.raises(AcceleratorError, match="not a registered accelerator"):
        select_accelerator_name()


def test_requested_but_unavailable(monkeypatch):
    monkeypatch.setenv("TITAN_ACCELERATOR", "cuda")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(AcceleratorError, match="not available"):
        get_accelerator()


def test_priority_order_picks_highest_available():
    class Fake(CpuAccelerator):
        name = "fake"

    register_accelerator("fake", Fake, is_available=lambda: True, priority=150)
    assert select_accelerator_name() == "fake"
    register_accelerator("fake", Fake, is_available=lambda: False, priority=150)
    assert select_accelerator_name() == "cpu"


def test_fake_musa_is_selected_first_and_answers(fake_musa):
    assert select_accelerator_name() == "musa"
    accel = get_accelerator()
    assert isinstance(accel, MusaAccelerator)
    assert accel.communication_backend() == "mccl"
    assert accel.weight_update_backend() == "cpu:gloo,musa:mccl"
    assert accel.device_type == "musa"  # torch.device("musa") needs the real torch_musa
    assert accel.visible_devices_env == "MUSA_VISIBLE_DEVICES"
    accel.set_device(0)
    accel.synchronize()
    accel.manual_seed(7)
    assert accel.mem_get_info() == (3, 8)
    assert accel.memory_stats()["mem/allocated"] == 5
    assert fake_musa == ["set_device(0)", "synchronize", "manual_seed(7)"]


def test_musa_env_means_musa(monkeypatch, fake_musa):
    register_accelerator("cuda", CpuAccelerator, is_available=lambda: True, priority=500)
    monkeypatch.setenv("MUSA_VISIBLE_DEVICES", "0")
    assert select_accelerator_name() == "musa"


def test_musa_patch_path_bootstrap(monkeypatch, tmp_path, fake_musa):
    """slime's MUSA bootstrap: MUSA_PATCH_PATH/musa_patch.patch_after_import_torch()."""
    (tmp_path / "musa_patch.py").write_text(
        "CALLED = []\ndef patch_after_import_torch():\n    CALLED.append(True)\n"
    )
    monkeypatch.setenv("MUSA_PATCH_PATH", str(tmp_path))
    monkeypatch.delitem(sys.modules, "musa_patch", raising=False)
    get_accelerator().post_import_torch()
    assert sys.modules["musa_patch"].CALLED == [True]
    monkeypatch.delitem(sys.modules, "musa_patch")


def test_cpu_streams_and_events_are_inert_but_time():
    accel = CpuAccelerator()
    s = accel.Stream()
    with accel.stream(s):
        pass
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record()
    end.record()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    assert accel.current_stream() == s


@pytest.mark.parametrize("value", ["titan", "auto", "TITAN"])
def test_slime_selecting_titan_leaves_the_choice_to_titan(monkeypatch, value):
    """``SLIME_ACCELERATOR=titan`` selects Titan in slime's registry (adapters.slime); for
    Titan's own registry it names no backend, so Titan picks by priority as without it."""
    own_choice = select_accelerator_name()
    monkeypatch.setenv("SLIME_ACCELERATOR", value)
    assert select_accelerator_name() == own_choice
    monkeypatch.setenv("SLIME_ACCELERATOR", "not-a-backend")  # any other value is a request
    with pytest.raises(AcceleratorError, match="not-a-backend"):
        select_accelerator_name()


# ---- device choices the rest of Titan asks the accelerator for ---------------------------


def test_profiler_activities_of_each_kind():
    from titan_core.accelerator.cuda import CudaAccelerator

    activity = torch.profiler.ProfilerActivity
    assert CpuAccelerator().profiler_activities() == [activity.CPU]
    assert CudaAccelerator().profiler_activities() == [activity.CPU, activity.CUDA]


def test_musa_profiles_its_kernels_as_torch_musa_names_them(monkeypatch, fake_musa):
    """torch_musa's own torch build has ``ProfilerActivity.MUSA``; a torch where torch_musa is
    the PrivateUse1 backend traces MUSA kernels as ``PrivateUse1``; neither: CPU only."""
    real = torch.profiler.ProfilerActivity
    accel = MusaAccelerator()
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "privateuseone")
    assert accel.profiler_activities() == [real.CPU]  # a plain torch: no MUSA activity
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "musa")
    assert accel.profiler_activities() == [real.CPU, real.PrivateUse1]
    with_musa = types.SimpleNamespace(CPU=real.CPU, PrivateUse1=real.PrivateUse1, MUSA="MUSA")
    monkeypatch.setattr(torch.profiler, "ProfilerActivity", with_musa)
    assert accel.profiler_activities() == [real.CPU, "MUSA"]


def test_ray_actors_keep_their_visible_devices():
    """Ray's GPU resource sets CUDA_VISIBLE_DEVICES (on MUSA nodes too): actors on device
    bundles ask Ray not to, CPU bundles need nothing."""
    from titan_core.accelerator.cuda import CudaAccelerator

    noset = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert CudaAccelerator().ray_actor_env() == noset
    assert MusaAccelerator().ray_actor_env() == noset
    assert CpuAccelerator().ray_actor_env() == {}


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("gloo", {"": "gloo"}),
        ("cpu:gloo,musa:mccl", {"cpu": "gloo", "musa": "mccl"}),
        (" CPU:gloo , cuda:NCCL ", {"cpu": "gloo", "cuda": "nccl"}),
    ],
)
def test_parse_backend_spec(spec, parsed):
    from titan_core.accelerator.base import parse_backend_spec

    assert parse_backend_spec(spec) == parsed


@pytest.mark.parametrize("spec", ["", "cpu:", ":gloo", "cpu:gloo,,musa:mccl"])
def test_parse_backend_spec_refuses_malformed(spec):
    from titan_core.accelerator.base import parse_backend_spec

    with pytest.raises(ValueError, match="device:backend pairs"):
        parse_backend_spec(spec)


def test_weight_update_backend_for_the_tensors_device(fake_musa):
    from titan_core.accelerator.cuda import CudaAccelerator

    musa = MusaAccelerator()
    assert musa.weight_update_backend_for("musa") == "mccl"
    assert musa.weight_update_backend_for("cpu") == "gloo"
    assert CudaAccelerator().weight_update_backend_for("cuda") == "nccl"
    assert CpuAccelerator().weight_update_backend_for("cpu") == "gloo"
    assert set(musa.weight_update_backends) == {"mccl", "gloo"}
    assert set(CudaAccelerator.weight_update_backends) == {"nccl", "gloo"}
    assert CpuAccelerator.weight_update_backends == ("gloo",)


def test_accelerator_named_needs_no_device():
    from titan_core.accelerator import accelerator_named
    from titan_core.accelerator.cuda import CudaAccelerator

    assert isinstance(accelerator_named("cuda"), CudaAccelerator)  # on any host
    with pytest.raises(AcceleratorError, match="not a registered accelerator"):
        accelerator_named("tpu")
