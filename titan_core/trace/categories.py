"""Event categories: which GPU events are kernels, and which kernels compute, talk or copy.

The patterns follow HTA's GPU kernel breakdown so that ``kernel_time_us`` matches it:
communication kernels are NCCL-style collective kernels (``^nccl.*Kernel``) plus RCCL,
HCCL and MCCL kernels; memory kernels are ``Memcpy*``, ``Memset*`` and ``dma*``; a few
kernels are "other" (anything containing ``Memcpy`` or ``Sync``, e.g. ``Stream Sync``)
and count in no category. Every list can be extended from a YAML/JSON config file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

COMPUTATION = "computation"
COMMUNICATION = "communication"
MEMORY = "memory"
OTHER = "other"
KINDS = (COMPUTATION, COMMUNICATION, MEMORY)
#: the category of a host annotation's mirror on a device stream (the span of the kernels
#: the host range launched; ROCm and newer CUDA traces): not a range or an op of its own
GPU_ANNOTATION = "gpu_user_annotation"

#: integer codes used in the columnar frames (cheap to store and compare)
KIND_CODE = {COMPUTATION: 0, COMMUNICATION: 1, MEMORY: 2, OTHER: 3}


@dataclass
class TraceConfig:
    """Analyzer settings; every field can be set from a config file (``--config``)."""

    comm_kernel_patterns: list[str] = field(
        default_factory=lambda: [
            r"^nccl.*Kernel",
            r"^ncclDevKernel",
            r"^rccl",
            r"^hccl",
            r"^mccl",
        ]
    )
    memory_kernel_patterns: list[str] = field(
        default_factory=lambda: [r"^Memcpy", r"^Memset", r"^dma"]
    )
    other_kernel_patterns: list[str] = field(default_factory=lambda: [r"Memcpy", r"Sync"])
    #: event categories that run on the device (kernels, copies, sets; ROCm and MTIA alike)
    gpu_event_cats: list[str] = field(
        default_factory=lambda: ["kernel", "gpu_memcpy", "gpu_memset", "mtia_kernel"]
    )
    #: host-side launch events carrying the ``correlation`` of a device event
    launch_cats: list[str] = field(
        default_factory=lambda: [
            "cuda_runtime",
            "cuda_driver",
            "mtia_runtime",
            "privateuse1_runtime",
        ]
    )
    #: host-side communication ops (CPU-only traces, P2P direction and peer lookup)
    cpu_comm_patterns: list[str] = field(
        default_factory=lambda: [
            r"^(nccl|rccl|hccl|mccl|gloo):",
            r"^c10d::",
            r"^record_param_comms$",
        ]
    )
    #: an idle gap up to this long between kernels is "kernel wait" (launch latency)
    kernel_wait_threshold_us: float = 30.0
    #: number of top kernels kept per rank
    top_kernels: int = 30
    #: the most text the reader holds at once, in bytes: one event, or the file's text
    #: before or after its events. A file that needs more is reported, not read on
    max_event_bytes: int = 256 << 20
    #: the most text one trace file may hold, in bytes, after inflation: a gzip bomb (or a
    #: trace too large to analyze in reasonable time) is reported once it passes this
    max_trace_bytes: int = 8 << 30

    def __post_init__(self) -> None:
        for name in ("max_event_bytes", "max_trace_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(
                    f"trace config {name} must be a positive whole number of bytes, got {v!r}"
                )
        self._comm = _join(self.comm_kernel_patterns)
        self._mem = _join(self.memory_kernel_patterns)
        self._other = _join(self.other_kernel_patterns)
        self._cpu_comm = _join(self.cpu_comm_patterns)

    def kernel_kind(self, name: str) -> str:
        """Classify a device event by name: communication, memory, other or computation."""
        if self._comm.match(name):
            return COMMUNICATION
        if self._mem.match(name):
            return MEMORY
        if self._other.match(name):
            return OTHER
        return COMPUTATION

    def is_cpu_comm(self, name: str) -> bool:
        return self._cpu_comm.match(name) is not None

    @classmethod
    def from_file(cls, path: str | Path | None) -> TraceConfig:
        """Load a config file (YAML or JSON); list fields given there are appended with
        ``extra_<field>`` or replaced with ``<field>``. Unknown keys are an error."""
        if path is None:
            return cls()
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            data: dict[str, Any] = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        names = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        extras: dict[str, list[str]] = {}
        for key, value in data.items():
            if key in names:
                kwargs[key] = value
            elif key.startswith("extra_") and key[6:] in names:
                extras[key[6:]] = list(value)
            else:
                raise ValueError(f"{path}: unknown trace config key {key!r}")
        cfg = cls(**kwargs)
        for key, value in extras.items():
            getattr(cfg, key).extend(value)
        cfg.__post_init__()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _join(patterns: list[str]) -> re.Pattern[str]:
    if not patterns:
        return re.compile(r"(?!x)x")
    return re.compile("|".join(f"(?:{p})" for p in patterns))


_ALGO_RE = re.compile(r"_(RING|TREE|COLLNET\w*|NVLS\w*|PAT)(?:_(LL128|LL|SIMPLE))?", re.I)
_COLL_RE = re.compile(
    r"(AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|SendRecv|Send|Recv|AllToAll|Gather|Scatter)",
    re.I,
)


@lru_cache(maxsize=8192)
def collective_from_kernel(name: str) -> tuple[str, str]:
    """(collective, algorithm) from a comm kernel name such as
    ``ncclKernel_AllReduce_RING_LL_Sum_float(...)`` or ``ncclDevKernel_AllGather_RING_LL``."""
    head = name.split("(", 1)[0]
    m = _COLL_RE.search(head)
    coll = m.group(1).lower() if m else "unknown"
    a = _ALGO_RE.search(head)
    algo = "_".join(g for g in a.groups() if g) if a else ""
    return coll, algo


_COLLECTIVE_ALIASES = {
    "alltoallv": "alltoall",
    "reducescattertensor": "reducescatter",
    "allgathertensor": "allgather",
    "batchisendirecv": "sendrecv",
}


@lru_cache(maxsize=8192)
def normalize_collective(name: str) -> str:
    """Canonical collective name: ``nccl:all_reduce``/``allreduce``/``AllReduce`` -> ``allreduce``."""
    n = name.split(":", 1)[-1].lower().strip("_")
    n = n.split(" ", 1)[0]
    n = n.replace("_", "").replace("base", "").replace("coalesced", "").replace("into", "")
    return _COLLECTIVE_ALIASES.get(n, n)


#: bus-bandwidth factor (nccl-tests convention) from the group size n
def busbw_factor(collective: str, n: int) -> float:
    if n <= 1:
        return 1.0
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    if collective in ("allgather", "reducescatter", "alltoall"):
        return (n - 1) / n
    return 1.0


DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "int": 4,
    "int32": 4,
    "long": 8,
    "int64": 8,
    "int8": 1,
    "uint8": 1,
    "byte": 1,
    "char": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "short": 2,
    "int16": 2,
}


@lru_cache(maxsize=1024)
def dtype_bytes(dtype: str | None) -> int:
    if not dtype:
        return 4
    d = dtype.lower().replace("c10::", "").replace("at::", "").replace("torch.", "")
    return DTYPE_BYTES.get(d, 4)
