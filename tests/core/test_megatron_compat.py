"""The CPU answers to megatron-core's CUDA calls, installed once and removable; the
device-rewriting part only inside ``megatron_scope``."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from titan_core.accelerator import megatron_scope
from titan_core.accelerator.cpu import CpuAccelerator
from titan_core.accelerator.cuda import CudaAccelerator
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
    with megatron_scope():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).to("cuda").device.type == "cpu"
        assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
        assert torch.empty(2, pin_memory=True).device.type == "cpu"


def test_outside_the_scope_cpu_tensors_are_plain_cpu_tensors(compat):
    """After start-up, code that does not call megatron-core (export, sync, the engine) sees
    no torch-function mode: CPU type names, and pickling as without the compat layer."""
    from megatron.core.utils import GlobalMemoryBuffer

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch.zeros(2, device="cpu").type() == "torch.FloatTensor"
    back = pickle.loads(pickle.dumps(t))
    assert torch.equal(back, t) and back.type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):  # no CUDA here, and no rewrite
        torch.zeros(2, device="cuda")
    with megatron_scope():
        assert torch._C._is_torch_function_mode_enabled()
        # megatron's own factory: device=torch.cuda.current_device()
        buf = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")
        assert buf.device.type == "cpu" and tuple(buf.shape) == (2, 3)
        assert t.type() == "torch.cuda.FloatTensor"
        assert torch.equal(pickle.loads(pickle.dumps(t)), t)
    assert not torch._C._is_torch_function_mode_enabled()
    assert t.type() == "torch.FloatTensor"


def test_scope_is_reentrant_and_per_thread(compat):
    seen: list[str] = []

    def other_thread() -> None:
        seen.append(torch.zeros(1).type())

    with megatron_scope():
        with megatron_scope():
            assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"  # still in the outer one
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert seen == ["torch.FloatTensor"]
    assert torch.zeros(1).type() == "torch.FloatTensor"


@megatron_scope()
def _decorated() -> str:
    return torch.zeros(1).type()


def test_scope_as_a_decorator_checks_at_each_call():
    assert _decorated() == "torch.FloatTensor"  # nothing installed: a no-op
    install_megatron_compat(CpuAccelerator())
    try:
        assert _decorated() == "torch.cuda.FloatTensor"
        assert _decorated() == "torch.cuda.FloatTensor"
    finally:
        uninstall_megatron_compat()
    assert _decorated() == "torch.FloatTensor"


def test_scope_is_a_noop_on_cuda():
    """megatron-core's native target: nothing to rewrite (on this CPU host, a cuda factory
    then fails as torch's own would)."""
    install_megatron_compat(CudaAccelerator())
    try:
        with megatron_scope():
            assert not torch._C._is_torch_function_mode_enabled()
            assert torch.zeros(1).type() == "torch.FloatTensor"
    finally:
        uninstall_megatron_compat()


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
    with megatron_scope():
        assert t.type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.int64).type() == "torch.cuda.LongTensor"
        assert t.type(torch.float64).dtype == torch.float64
    assert t.type() == "torch.FloatTensor"


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


class _CopyOnDevice(torch.autograd.Function):
    """Like megatron's all-to-all: its forward (also run by its backward) makes its output
    with ``device=torch.cuda.current_device()``."""

    @staticmethod
    def forward(ctx, x):
        return x.new_empty(x.shape, device=torch.cuda.current_device()).copy_(x)

    @staticmethod
    def backward(ctx, grad):
        return _CopyOnDevice.apply(grad)


@pytest.mark.parametrize("top", ["tensor", "autograd"])
def test_backward_nodes_run_in_the_scope(compat, top):
    """A reentrant recompute (megatron's CheckpointFunction calls torch.autograd.backward in
    its backward) reruns the forward inside the engine, where a torch-function mode is off
    unless the scope enters it again."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(4, requires_grad=True)
    with megatron_scope():
        y = checkpoint(lambda t: _CopyOnDevice.apply(t * 3), x, use_reentrant=True)
        loss = (y * y).sum()
        loss.backward() if top == "tensor" else torch.autograd.backward([loss])
    assert torch.allclose(x.grad, 18 * x.detach())  # d/dx (3x)^2
