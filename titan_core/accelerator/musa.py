"""The MUSA backend (Moore Threads): torch_musa's ``torch.musa`` module and MCCL.

megatron-core and SGLang speak ``torch.cuda``; on MUSA, ``torchada`` (Moore Threads'
adapter) makes torch_musa answer ``torch.cuda.*``, ``device="cuda"`` and ``nccl``. It is
loaded in :meth:`MusaAccelerator.post_import_torch`, at start-up, never at import.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch

from titan_core.accelerator.cuda import CudaAccelerator, _importable


class MusaAccelerator(CudaAccelerator):
    name = "musa"
    device_type = "musa"
    visible_devices_env = "MUSA_VISIBLE_DEVICES"
    #: Ray does not detect MUSA devices: a local Ray is started with ``num_gpus`` set to
    #: the device count; cluster nodes need ``ray start --num-gpus N``. Ray's GPU resource
    #: sets CUDA_VISIBLE_DEVICES (the inherited ``ray_visible_devices_env``), not MUSA's.
    ray_resource = "GPU"
    weight_update_backends = ("mccl", "gloo")
    _default_comm = "mccl"

    @property
    def accelerator_module(self) -> Any:
        module = getattr(torch, "musa", None)
        if module is None:
            try:
                importlib.import_module("torch_musa")
            except ImportError:
                return None
            module = getattr(torch, "musa", None)
        return module

    def is_available(self) -> bool:
        module = self.accelerator_module
        return bool(module is not None and module.is_available())

    def supports(self, capability: str) -> bool:
        if capability in {"ipc_handles", "pin_memory", "batched_p2p"}:
            return True
        if capability == "fused_kernels":  # megatron's local spec takes them from Apex
            return _importable("apex")
        if capability in {"transformer_engine", "fp8"}:
            return _importable("transformer_engine")  # MT-TransformerEngine
        if capability == "deep_ep":
            return _importable("deep_ep")  # MT-DeepEP
        return False

    def weight_update_backend(self, default: str | None = None) -> str:
        # CPU tensors travel over gloo, device tensors over MCCL (slime's convention).
        return default or "cpu:gloo,musa:mccl"

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """CPU, and MUSA kernels: torch_musa's own torch build names the activity
        ``ProfilerActivity.MUSA``; where torch_musa is torch's PrivateUse1 backend, kernels
        are traced as ``PrivateUse1`` (torchada maps ``CUDA`` to it for the same reason).
        Neither: CPU only, as on a torch that cannot trace MUSA kernels."""
        self.accelerator_module  # noqa: B018 - torch_musa registers its activity on import
        activity = torch.profiler.ProfilerActivity
        device = getattr(activity, "MUSA", None)
        if device is None and _privateuse1_backend() == "musa":
            device = getattr(activity, "PrivateUse1", None)
        return [activity.CPU] if device is None else [activity.CPU, device]

    def post_import_torch(self) -> None:
        """Load torchada so torch_musa answers megatron-core's ``torch.cuda`` calls.

        Also honours slime's ``MUSA_PATCH_PATH`` bootstrap: a ``musa_patch`` module found
        there has its ``patch_after_import_torch()`` called (once: :func:`call_patch_hook`).
        """
        self.accelerator_module  # noqa: B018 - imports torch_musa if needed
        if _importable("torchada"):
            importlib.import_module("torchada")
        patch_path = os.environ.get("MUSA_PATCH_PATH")
        if patch_path:
            if patch_path not in sys.path:
                sys.path.append(patch_path)
            try:
                patch = importlib.import_module("musa_patch")
            except ImportError:
                return
            call_patch_hook(patch)


#: set on a ``musa_patch`` module once its ``patch_after_import_torch()`` has run
_HOOK_DONE = "__titan_patch_hook_done__"


def call_patch_hook(module: Any) -> bool:
    """Call a ``musa_patch`` module's ``patch_after_import_torch()`` once per process,
    whoever asks (this accelerator, slime's MUSA backend through Titan's bootstrap, the
    adapters' vendor step). Returns whether it was called now."""
    hook = getattr(module, "patch_after_import_torch", None)
    if not callable(hook) or getattr(module, _HOOK_DONE, False):
        return False
    setattr(module, _HOOK_DONE, True)
    hook()
    return True


def _privateuse1_backend() -> str | None:
    """The name torch's PrivateUse1 device is registered under ("musa" once torch_musa
    registered itself), or None where this torch cannot say."""
    get_name = getattr(torch._C, "_get_privateuse1_backend_name", None)
    return get_name() if callable(get_name) else None
