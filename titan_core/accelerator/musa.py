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
    #: the device count; cluster nodes need ``ray start --num-gpus N``.
    ray_resource = "GPU"
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

    def post_import_torch(self) -> None:
        """Load torchada so torch_musa answers megatron-core's ``torch.cuda`` calls.

        Also honours slime's ``MUSA_PATCH_PATH`` bootstrap: a ``musa_patch`` module found
        there has its ``patch_after_import_torch()`` called, as slime does.
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
            hook = getattr(patch, "patch_after_import_torch", None)
            if callable(hook):
                hook()
