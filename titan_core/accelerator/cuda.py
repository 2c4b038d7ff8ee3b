"""The CUDA backend: megatron-core's native target, so it only forwards to ``torch.cuda``."""

from __future__ import annotations

from typing import Any

import torch

from titan_core.accelerator.base import Accelerator


class CudaAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"
    ray_visible_devices_env = "CUDA_VISIBLE_DEVICES"
    weight_update_backends = ("nccl", "gloo")
    _default_comm = "nccl"

    @property
    def accelerator_module(self) -> Any:
        return torch.cuda

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.device_type, self.current_device() if index is None else index)

    def set_device(self, index: int) -> None:
        self.accelerator_module.set_device(index)

    def current_device(self) -> int:
        return self.accelerator_module.current_device()

    def device_count(self) -> int:
        return self.accelerator_module.device_count()

    def distributed_device_id(self, local_rank: int) -> torch.device | None:
        return self.device(self.resolve_visible_device_id(local_rank))

    def synchronize(self, device: Any = None) -> None:
        self.accelerator_module.synchronize(device)

    def current_stream(self, device: Any = None) -> Any:
        return self.accelerator_module.current_stream(device)

    def default_stream(self, device: Any = None) -> Any:
        return self.accelerator_module.default_stream(device)

    def stream(self, stream: Any) -> Any:
        return self.accelerator_module.stream(stream)

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        return self.accelerator_module.Stream(*args, **kwargs)

    def Event(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        return self.accelerator_module.Event(*args, **kwargs)

    def empty_cache(self) -> None:
        self.accelerator_module.empty_cache()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self.accelerator_module.mem_get_info(device)

    def memory_allocated(self, device: Any = None) -> int:
        return self.accelerator_module.memory_allocated(device)

    def memory_reserved(self, device: Any = None) -> int:
        return self.accelerator_module.memory_reserved(device)

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.accelerator_module.max_memory_allocated(device)

    def memory_saver(self, tag: str) -> Any:
        """torch_memory_saver where installed with its preload hook loaded (CUDA only)."""
        if self.device_type != "cuda":
            return None
        from titan_core.accelerator.memory_saver import find_memory_saver

        return find_memory_saver(tag)

    def ipc_collect(self) -> None:
        self.accelerator_module.ipc_collect()

    def get_device_properties(self, device: Any = None) -> Any:
        return self.accelerator_module.get_device_properties(device or self.current_device())

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.accelerator_module.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.accelerator_module.manual_seed_all(seed)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return self.accelerator_module.get_rng_state(device or self.device_type)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        self.accelerator_module.set_rng_state(state, device or self.device_type)

    def supports(self, capability: str) -> bool:
        if capability in {"ipc_handles", "pin_memory", "batched_p2p"}:
            return True
        if capability == "fused_kernels":  # megatron's local spec takes them from Apex
            return _importable("apex")
        if capability in {"transformer_engine", "fp8"}:
            return _importable("transformer_engine")
        if capability == "deep_ep":
            return _importable("deep_ep")
        return False

    def communication_backend(self, default: str | None = None) -> str:
        return default or self._default_comm

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
