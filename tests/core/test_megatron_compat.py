"""The CPU answers to megatron-core's CUDA calls, installed once and removable."""

from __future__ import annotations

import pytest
import torch

from titan_core.accelerator.cpu import CpuAccelerator
from titan_core.accelerator.megatron_compat import (
    install_megatron_compat,
    megatron_compat_installed,
    uninstall_megatron_compat,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compat is for CPU hosts")


@pytest.fixture
def compat():
    install_megatron_compat(CpuAccelerator())
    yield
    uninstall_megatron_compat()


def test_factories_and_moves_land_on_cpu(compat):
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
    assert torch.empty(2, pin_memory=True).device.type == "cpu"


def test_rng_tracker_forks_the_cpu_generator(compat):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default state"
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "the tracked state advances between forks"
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), a)


def test_streams_nvtx_and_type_strings(compat):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.ones(2)
    t.record_stream(torch.cuda.current_stream())
    torch.cuda.nvtx.range_push("x")
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    assert t.type() == "torch.cuda.FloatTensor"
    assert t.type(torch.float64).dtype == torch.float64


def test_moe_split_sizes_become_numpy(compat):
    from megatron.core.transformer.moe import moe_utils

    out = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    assert out.tolist() == [1, 2] and not torch.is_tensor(out)


def test_install_is_idempotent_and_uninstall_restores():
    original = torch.cuda.current_device
    install_megatron_compat(CpuAccelerator())
    install_megatron_compat(CpuAccelerator())
    assert megatron_compat_installed() == "cpu"
    uninstall_megatron_compat()
    assert torch.cuda.current_device is original
    assert megatron_compat_installed() is None
    assert torch.ones(1).type() == "torch.FloatTensor"
