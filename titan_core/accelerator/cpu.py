"""The CPU backend: the reference path CI runs (gloo, inert streams and events)."""

from __future__ import annotations

import os
from typing import Any

import torch

from titan_core.accelerator.base import Accelerator


class InertStream:
    """Stands where a device stream is asked for on CPU: every operation is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> InertEvent:
        event = event or InertEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def __enter__(self) -> InertStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InertStream)

    def __hash__(self) -> int:
        return 0


class InertEvent:
    """A CPU event: records wall time so ``elapsed_time`` still means something."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kwargs: Any) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: InertEvent) -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end._t - self._t) * 1000.0


_DEFAULT_STREAM = InertStream()


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory from /proc/meminfo."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except OSError:
        return 0, 0
    return info.get("MemAvailable", 0), info.get("MemTotal", 0)


class CpuAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    sequence_multiple = 1
    #: megatron's CPU path calls none of its fusion functions but one integer count, and
    #: decorating them with ``torch.compile`` imports dynamo and inductor (~1.5 s of its import)
    compiles_megatron_fusions = False

    def is_available(self) -> bool:
        return True

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: Any = None) -> None:
        pass

    def current_stream(self, device: Any = None) -> InertStream:
        return _DEFAULT_STREAM

    def Stream(self, *args: Any, **kwargs: Any) -> InertStream:  # noqa: N802
        return InertStream()

    def Event(self, *args: Any, **kwargs: Any) -> InertEvent:  # noqa: N802
        return InertEvent(*args, **kwargs)

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return _host_memory()

    def memory_allocated(self, device: Any = None) -> int:
        return _rss_bytes()

    def memory_reserved(self, device: Any = None) -> int:
        return _rss_bytes()

    def supports(self, capability: str) -> bool:
        return capability in {"requires_cpu_initialization"}

    def communication_backend(self, default: str | None = None) -> str:
        return "gloo"

    def autocast(self, dtype: torch.dtype | None = None, enabled: bool = True) -> Any:
        return torch.autocast(device_type="cpu", dtype=dtype or torch.bfloat16, enabled=enabled)


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
