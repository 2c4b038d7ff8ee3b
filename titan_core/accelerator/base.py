"""The Accelerator interface: everything Titan asks of a device kind.

The shape follows slime's accelerator registry (``slime/utils/accelerator``) so a slime or
miles user finds the same names; device-specific code lives only in this package.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

import torch


class Accelerator(ABC):
    """One device kind (cuda, musa, cpu)."""

    name: str = "abstract"
    #: torch device type used for tensors (``"cuda"``, ``"musa"``, ``"cpu"``).
    device_type: str = "cpu"
    #: tokens a training microbatch's length is rounded up to: a multiple the GPUs' matrix
    #: units tile well (8); a CPU gains nothing from padding, so 1 there.
    sequence_multiple: int = 8
    #: environment variable that restricts visible devices, if the kind has one.
    visible_devices_env: str | None = None
    #: Ray's resource name for one device of this kind (placement-group bundles are one
    #: device each); None: no device resource, the bundles hold CPU only.
    ray_resource: str | None = None
    #: the visible-devices variable Ray itself sets for actors holding ``ray_resource``
    #: (Ray's GPU resource sets CUDA_VISIBLE_DEVICES, on MUSA nodes too); None: none.
    ray_visible_devices_env: str | None = None
    #: process-group backends a weight-update group may use (``sync.distributed.backend``): the
    #: device's own, and gloo (CPU tensors travel over gloo everywhere).
    weight_update_backends: tuple[str, ...] = ("gloo",)
    #: megatron-core's fusion functions (``megatron.core.jit.jit_fuser``) run through
    #: ``torch.compile`` (megatron's own choice); False: eagerly, and megatron-core is
    #: imported without the compiler (``megatron_compat.import_megatron``).
    compiles_megatron_fusions: bool = True

    # ---- identity and placement -------------------------------------------------------
    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def device(self, index: int | None = None) -> torch.device: ...

    def device_name(self, index: int | None = None) -> str:
        return str(self.device(index))

    @abstractmethod
    def set_device(self, index: int) -> None: ...

    @abstractmethod
    def current_device(self) -> int: ...

    @abstractmethod
    def device_count(self) -> int: ...

    def distributed_device_id(self, local_rank: int) -> torch.device | None:
        """The ``device_id`` to pass to ``init_process_group`` (None where not applicable)."""
        return None

    def resolve_visible_device_id(self, local_rank: int) -> int:
        return local_rank % max(self.device_count(), 1)

    # ---- sync, streams, events -----------------------------------------------------------
    @abstractmethod
    def synchronize(self, device: Any = None) -> None: ...

    @abstractmethod
    def current_stream(self, device: Any = None) -> Any: ...

    def default_stream(self, device: Any = None) -> Any:
        return self.current_stream(device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - torch's name
        raise NotImplementedError(f"{self.name} has no streams")

    def Event(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - torch's name
        raise NotImplementedError(f"{self.name} has no events")

    # ---- memory ----------------------------------------------------------------------
    @abstractmethod
    def empty_cache(self) -> None: ...

    @abstractmethod
    def mem_get_info(self, device: Any = None) -> tuple[int, int]: ...

    @abstractmethod
    def memory_allocated(self, device: Any = None) -> int: ...

    @abstractmethod
    def memory_reserved(self, device: Any = None) -> int: ...

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.memory_allocated(device)

    def ipc_collect(self) -> None:
        return None

    def get_device_properties(self, device: Any = None) -> Any:
        return None

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer for copies to and from the device: pinned where the device
        kind pins (asynchronous, faster copies), plain host memory otherwise."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.supports("pin_memory"))

    def memory_saver(self, tag: str) -> Any:
        """A ``titan_core.accelerator.memory_saver.MemorySaver`` that releases the device
        memory of allocations tagged ``tag`` and restores it, where the device kind has
        one in use in this process; None: the caller frees storages itself."""
        return None

    def memory_stats(self) -> dict[str, int]:
        """A small, uniform set of memory figures for metrics.jsonl."""
        free, total = self.mem_get_info()
        return {
            "mem/allocated": self.memory_allocated(),
            "mem/reserved": self.memory_reserved(),
            "mem/max_allocated": self.max_memory_allocated(),
            "mem/free": free,
            "mem/total": total,
        }

    # ---- RNG -------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    # ---- capabilities and communication ------------------------------------------------
    def supports(self, capability: str) -> bool:
        """Capabilities: requires_cpu_initialization, fused_kernels (Apex's persistent
        LayerNorm and fused masked softmax, which megatron's local layer spec asserts on when
        asked for without Apex), transformer_engine, deep_ep, ipc_handles, pin_memory, fp8,
        batched_p2p (batched isend/irecv is safe)."""
        return False

    def autocast(self, dtype: torch.dtype | None = None, enabled: bool = True) -> Any:
        return torch.autocast(device_type=self.device_type, dtype=dtype, enabled=enabled)

    @abstractmethod
    def communication_backend(self, default: str | None = None) -> str:
        """The torch.distributed backend for training process groups."""

    def weight_update_backend(self, default: str | None = None) -> str:
        """The backend for trainer -> rollout engine weight broadcast groups: one name, or
        torch's per-device form (``"cpu:gloo,musa:mccl"``)."""
        return self.communication_backend(default)

    def weight_update_backend_for(self, device_type: str) -> str:
        """The one backend a weight-update group broadcasting ``device_type`` tensors uses
        (SGLang's ``init_weights_update_group`` takes a single name)."""
        by_device = parse_backend_spec(self.weight_update_backend())
        for key in (device_type, self.device_type, ""):
            if key in by_device:
                return by_device[key]
        return next(reversed(by_device.values()))

    # ---- profiling and placement --------------------------------------------------------
    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """What ``torch.profiler.profile`` records on this kind: the CPU, and the device's
        kernels where torch can trace them."""
        return [torch.profiler.ProfilerActivity.CPU]

    def ray_actor_env(self) -> dict[str, str]:
        """Environment of Ray actors on device bundles: Ray leaves the visible devices alone,
        so every actor sees its node's devices and picks its own by the bundle's device id
        (the trainer's LOCAL_RANK, SGLang's base_gpu_id), as slime does."""
        if self.ray_visible_devices_env is None:
            return {}
        return {f"RAY_EXPERIMENTAL_NOSET_{self.ray_visible_devices_env}": "1"}

    def post_import_torch(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Hook run once at start-up, after torch is imported (MUSA loads torchada here)."""

    @property
    def accelerator_module(self) -> Any:
        """The torch submodule for this kind (``torch.cuda``, ``torch.musa``), if any."""
        return None

    def __repr__(self) -> str:
        return f"<Accelerator {self.name} device_type={self.device_type}>"


def parse_backend_spec(spec: str) -> dict[str, str]:
    """torch.distributed's backend string as device type -> backend, in order: ``"gloo"`` ->
    ``{"": "gloo"}`` (every device), ``"cpu:gloo,musa:mccl"`` -> ``{"cpu": "gloo", "musa":
    "mccl"}``."""
    out: dict[str, str] = {}
    for part in spec.split(","):
        device, sep, backend = part.strip().rpartition(":")
        if not backend or (sep and not device):
            raise ValueError(
                f"backend {spec!r}: expected a backend name (gloo, nccl, ...) or "
                "device:backend pairs separated by commas (cpu:gloo,cuda:nccl)"
            )
        out[device.strip().lower()] = backend.strip().lower()
    return out
