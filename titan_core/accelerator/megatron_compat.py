"""Where megatron-core's CUDA assumptions are answered on MUSA and CPU.

megatron-core has no accelerator abstraction: it calls ``torch.cuda`` hundreds of times,
creates tensors with ``device="cuda"`` and moves modules with ``.cuda()``. Titan answers
those calls here and nowhere else, in two parts:

* :func:`install_megatron_compat`, one explicit step at start-up (``titan_core.parallel.
  initialize``, never at import time), patches functions process-wide. On CPU each patch
  only answers a call that would otherwise fail on a host without a device (there is no
  ``torch.cuda.current_device()`` to give), so code outside megatron-core is unaffected.
* :func:`megatron_scope`, a context (or decorator) around each call into megatron-core
  (model build, optimizer build and step, the schedules, checkpoint save and load). On CPU
  it adds what would change or slow down other code: the device-rewriting torch-function
  mode (it sees every torch call: pickling a small tensor under it is over 10x slower) and
  the ``torch.cuda.*`` type strings. Outside it (weight export, sync, the engine) a CPU
  tensor is a CPU tensor. On cuda and musa it is a no-op.

* **cuda**: nothing to do (megatron-core's native target). Where Transformer Engine is
  absent, megatron-core 0.16.1's router references ``te_general_gemm`` without defining
  it; it is defined as ``None`` so the router takes its torch path.
* **musa**: ``torchada`` (Moore Threads' adapter, loaded by the accelerator's
  ``post_import_torch``) already makes torch_musa answer ``torch.cuda.*``,
  ``device="cuda"`` and ``nccl``; only the ``te_general_gemm`` fix applies.
* **cpu**: the full list of ../shared/reference/megatron-on-cpu.md, each item below:

  1. ``torch.cuda.current_device/synchronize/empty_cache/memory_*`` -> the CPU backend.
  2. RNG: ``torch.cuda.{get,set}_rng_state/manual_seed(_all)`` and megatron's
     ``tensor_parallel.random._{get,set}_cuda_rng_state`` -> the CPU generator, so the
     model-parallel RNG tracker forks and restores the generator CPU ops really use.
  3. Tensor factories with ``device="cuda"`` (or an int index): a ``TorchFunctionMode``
     rewrites the device to CPU and drops ``pin_memory`` (in :func:`megatron_scope`);
     ``Tensor.cuda``/``Module.cuda`` return CPU objects.
  4. ``torch.cuda.Stream/Event/current_stream/stream/default_stream`` -> inert CPU
     stand-ins; ``Tensor.record_stream`` is a no-op on CPU tensors.
  5. Offloading: ``pin_memory`` is a no-op without a driver, and megatron's fine-grained
     activation offload, which flags Transformer Engine's ``cpu_offload`` module while it
     runs, gets a stand-in for that flag where TE is absent.
  6. MoE all-to-all: ``moe_utils.maybe_move_tensor_to_cpu`` also converts CPU tensors to
     numpy when asked, so split sizes are lists, as on GPU.
  7. ``torch.cuda.nvtx.range_push/range_pop/range`` -> no-ops.
  8. ``moe_utils.te_general_gemm`` -> ``None`` without Transformer Engine.
  9. Type strings: the optimizer and gradient clipping check ``t.type() ==
     "torch.cuda.FloatTensor"``; in :func:`megatron_scope`, argument-less ``Tensor.type()``
     of a CPU tensor answers with the ``torch.cuda.*`` name (with an argument it converts,
     as always).

Everything patched is recorded, so :func:`uninstall_megatron_compat` restores it (tests).

Before either, :func:`import_megatron` is a process's first import of megatron-core (the
trainer's build, ``titan_core.pretrain``, the slime / miles backend's ranks and its
``convert_hf_to_torch_dist``). Where the accelerator runs megatron's fusion
functions eagerly (``Accelerator.compiles_megatron_fusions`` False: CPU), it imports
megatron-core without ``torch.compile``. ``megatron.core.jit`` sets ``jit_fuser =
torch.compile`` at its import and some 25 modules decorate functions with it as they load; each
decoration imports dynamo and inductor (~1.5 s of the 3 s import here) for functions a CPU
run never compiles. So for that one import ``torch.compile`` answers as the identity, then
megatron's own ``disable_jit_fuser()`` makes the modules imported later take its no-op
decorator, and ``torch.compile`` is itself again. The one such function the CPU path calls
(the MoE router's ``_apply_expert_bias``, an integer count) then runs eagerly: the same values.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from titan_core.accelerator.base import Accelerator
from titan_core.accelerator.cpu import InertEvent, InertStream
from titan_core.accelerator.registry import get_accelerator

_PATCHES: list[tuple[Any, str, Any]] = []
_INSTALLED_FOR: str | None = None
#: whether :func:`megatron_scope` enters the CPU mode (compat installed for a CPU accelerator)
_SCOPE_NEEDS_MODE = False
#: the mode stack is per thread, and so is "this thread is inside a scope"
_SCOPE = threading.local()
_MISSING = object()
_TENSOR_TYPE = torch.Tensor.type
_TENSOR_TO = torch.Tensor.to
_TENSOR_BACKWARD = torch.Tensor.backward
_TENSOR_BACKWARD_SIGNATURE = inspect.signature(torch.Tensor.backward)


def _patch(owner: Any, name: str, value: Any) -> None:
    _PATCHES.append((owner, name, getattr(owner, name, _MISSING)))
    setattr(owner, name, value)


def _is_accel_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuDeviceMode(TorchFunctionMode):
    """Inside :func:`megatron_scope` on CPU: rewrites ``device="cuda"`` (and int device
    indices) to CPU in every torch call, and answers ``Tensor.type()`` with the CUDA name."""

    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None):
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_accel_device(device):
                kwargs = dict(kwargs)
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs = dict(kwargs)
                kwargs["pin_memory"] = False
        if args and func is _TENSOR_TO and _is_accel_device(args[1] if len(args) > 1 else None):
            args = (args[0], "cpu", *args[2:])
        if func is torch.autograd.backward:
            return _backward_in_scope(*args, **(kwargs or {}))
        if func is _TENSOR_BACKWARD:
            bound = _TENSOR_BACKWARD_SIGNATURE.bind(*args, **(kwargs or {})).arguments
            return _backward_in_scope(
                bound["self"], bound.get("gradient"), bound.get("retain_graph"),
                bound.get("create_graph", False), inputs=bound.get("inputs"),
            )  # fmt: skip
        result = func(*args, **(kwargs or {}))
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0], result)
        return result


def _backward_in_scope(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward`` (and ``Tensor.backward``) with the backward nodes run
    inside the CPU mode.

    A torch-function mode is off while it handles a call, and the autograd engine runs the
    nodes inside that call: megatron's reentrant recompute (``CheckpointFunction.backward``
    calls ``torch.autograd.backward``) reruns its forward there, where a ``device=
    torch.cuda.current_device()`` (its MoE all-to-all) needs the mode. So the engine is
    run directly (as megatron's own ``custom_backward`` does) with the mode entered again.
    """
    if grad_variables is not None:
        grad_tensors = grad_variables
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
        grad_tensors = [grad_tensors] * len(tensors) if grad_tensors is None else [grad_tensors]
    grads = tuple(
        torch.ones_like(t, memory_format=torch.preserve_format) if g is None else g
        for t, g in zip(tensors, grad_tensors, strict=True)
    )
    if inputs is None:
        inputs = ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    else:
        inputs = tuple(inputs)
    with _CpuDeviceMode():
        torch.autograd.Variable._execution_engine.run_backward(
            tensors, grads, create_graph if retain_graph is None else retain_graph,
            create_graph, inputs, allow_unreachable=True, accumulate_grad=True,
        )  # fmt: skip


def _cuda_type_name(tensor: torch.Tensor, name: str) -> str:
    """``torch.FloatTensor`` of a CPU tensor -> ``torch.cuda.FloatTensor`` (item 9)."""
    if tensor.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
        return "torch.cuda." + name[len("torch.") :]
    return name


@contextlib.contextmanager
def megatron_scope() -> Iterator[None]:
    """Around calls into megatron-core: on CPU, its ``device="cuda"`` tensors land on the CPU
    and CPU tensors report ``torch.cuda.*`` types; elsewhere (cuda, musa, or before
    :func:`install_megatron_compat`) a no-op. Re-entrant; applies to the calling thread."""
    if not _SCOPE_NEEDS_MODE or getattr(_SCOPE, "active", False):
        yield
        return
    _SCOPE.active = True
    try:
        with _CpuDeviceMode():
            yield
    finally:
        _SCOPE.active = False


def _cpu_rng_get(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state.cpu() if state.device.type != "cpu" else state)


def _noop_factory(name: str) -> Callable[..., None]:
    # One function object per patched name: torch.compile's rule table keys on identity.
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    noop.__name__ = noop.__qualname__ = name
    return noop


def _install_cpu(accel: Accelerator) -> None:
    cuda = torch.cuda
    # 1. device queries, sync, memory
    _patch(cuda, "current_device", accel.current_device)
    _patch(cuda, "set_device", _noop_factory("set_device"))
    _patch(cuda, "synchronize", _noop_factory("synchronize"))
    _patch(cuda, "empty_cache", _noop_factory("empty_cache"))
    _patch(cuda, "memory_allocated", lambda *a, **k: accel.memory_allocated())
    _patch(cuda, "max_memory_allocated", lambda *a, **k: accel.max_memory_allocated())
    _patch(cuda, "memory_reserved", lambda *a, **k: accel.memory_reserved())
    _patch(cuda, "max_memory_reserved", lambda *a, **k: accel.memory_reserved())
    _patch(cuda, "reset_peak_memory_stats", _noop_factory("reset_peak_memory_stats"))
    _patch(cuda, "mem_get_info", lambda *a, **k: accel.mem_get_info())
    # 2. RNG
    _patch(cuda, "get_rng_state", _cpu_rng_get)
    _patch(cuda, "set_rng_state", _cpu_rng_set)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.
    _patch(
        cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    )
    _patch(cuda, "manual_seed_all", _noop_factory("manual_seed_all"))
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    _patch(random_mod, "_get_cuda_rng_state", lambda *a, clone=False, **k: _cpu_rng_get().clone())
    _patch(random_mod, "_set_cuda_rng_state", lambda state, *a, **k: _cpu_rng_set(state))
    # 3. factories and .cuda()
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _patch(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    # factories: _CpuDeviceMode, entered by megatron_scope
    # 4. streams and events
    # classes, not bound methods: other libraries annotate with ``torch.cuda.Stream | None``
    _patch(cuda, "Stream", InertStream)
    _patch(cuda, "Event", InertEvent)
    _patch(cuda, "current_stream", accel.current_stream)
    _patch(cuda, "default_stream", accel.default_stream)
    _patch(cuda, "stream", lambda s=None: contextlib.nullcontext())
    original_record_stream = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type != "cpu":
            original_record_stream(self, stream)

    _patch(torch.Tensor, "record_stream", record_stream)
    # 9. type strings: _CpuDeviceMode, entered by megatron_scope
    # 5. pinned memory
    _patch(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    te_ext = importlib.import_module("megatron.core.extensions.transformer_engine")
    if getattr(te_ext, "cpu_offload", None) is None:
        _patch(te_ext, "cpu_offload", types.SimpleNamespace(CPUOffloadEnabled=False))
    # 7. nvtx
    nvtx = importlib.import_module("torch.cuda.nvtx")
    _patch(nvtx, "range_push", _noop_factory("range_push"))
    _patch(nvtx, "range_pop", _noop_factory("range_pop"))
    _patch(nvtx, "range", lambda *a, **k: contextlib.nullcontext())
    _patch(nvtx, "mark", _noop_factory("mark"))
    # 6. MoE all-to-all split sizes
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    original_move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _patch(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    for name in ("token_dispatcher", "experts"):
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(f"megatron.core.transformer.moe.{name}")
            if hasattr(mod, "maybe_move_tensor_to_cpu"):
                _patch(mod, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _install_te_gemm_fallback() -> None:
    # 8. megatron-core 0.16.1 references te_general_gemm in the router even without TE.
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None)


@contextlib.contextmanager
def _compile_as_identity() -> Iterator[None]:
    """``torch.compile`` (as a call or a decorator factory) returns what it is given."""

    def identity(model: Any = None, **kwargs: Any) -> Any:
        return (lambda fn: fn) if model is None else model

    original = torch.compile
    torch.compile = identity  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


def import_megatron(accel: Accelerator | None = None) -> None:
    """Import megatron-core for ``accel`` (None: this process's, ``get_accelerator()``; see
    the module's docstring): without ``torch.compile`` on its fusion functions where
    ``accel`` runs them eagerly. A process that has imported megatron-core already keeps it
    as it is."""
    if accel is None:
        accel = get_accelerator()
    if "megatron.core" in sys.modules or accel.compiles_megatron_fusions:
        importlib.import_module("megatron.core")
        return
    with _compile_as_identity():
        importlib.import_module("megatron.core")
        importlib.import_module("megatron.core.jit").disable_jit_fuser()


def install_megatron_compat(accel: Accelerator) -> None:
    """Answer megatron-core's CUDA calls with ``accel``. Idempotent; once per process."""
    global _INSTALLED_FOR, _SCOPE_NEEDS_MODE
    if _INSTALLED_FOR is not None:
        if accel.name != _INSTALLED_FOR:
            raise RuntimeError(
                f"megatron compat is installed for {_INSTALLED_FOR}, cannot switch to {accel.name}"
            )
        return
    accel.post_import_torch()
    _install_te_gemm_fallback()
    if accel.device_type == "cpu":
        _install_cpu(accel)
        _SCOPE_NEEDS_MODE = True
    _INSTALLED_FOR = accel.name


def uninstall_megatron_compat() -> None:
    """Undo :func:`install_megatron_compat` (for tests that switch backends)."""
    global _INSTALLED_FOR, _SCOPE_NEEDS_MODE
    _SCOPE_NEEDS_MODE = False
    while _PATCHES:
        owner, name, old = _PATCHES.pop()
        if old is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, old)
    _INSTALLED_FOR = None


def megatron_compat_installed() -> str | None:
    """The accelerator name the compat layer was installed for, or None."""
    return _INSTALLED_FOR
