"""Communication ops of one rank: collectives and P2P, with sizes, groups and peers.

A comm op is a device comm kernel (NCCL/RCCL/HCCL/MCCL) or, in CPU-only traces, a host
comm range (``gloo:send``, ``c10d::recv_``...). What it is comes from the kernel's own args
(newer PyTorch), else from the host ranges around its launch: ``record_param_comms`` args,
``nccl:all_reduce`` names, ``nccl:send 0->1`` / ``nccl:recv 1<-0`` for P2P peers, or
Titan's ``titan/p2p/{send|recv}/peer{R}`` ranges.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from operator import itemgetter
from typing import Any

from titan_core.trace.categories import (
    GPU_ANNOTATION,
    KIND_CODE,
    TraceConfig,
    collective_from_kernel,
    dtype_bytes,
    normalize_collective,
)
from titan_core.trace.columns import COMM_FIELDS, Events
from titan_core.trace.device_events import GpuEvents

P2P = {"send", "recv", "sendrecv"}
_PEER_RE = re.compile(r"(send|recv)\D*?(\d+)\s*(->|<-)\s*(\d+)", re.I)
_TITAN_P2P_RE = re.compile(r"titan/p2p/(send|recv)/peer(\d+)")
_MB_RE = re.compile(r"titan/microbatch/(fwd|bwd)")
_SEND_RE = re.compile(r"(^|[:_])send")
_RECV_RE = re.compile(r"(^|[:_])recv")


@dataclass
class CommOp:
    ts: int
    end: int
    collective: str
    algo: str = ""
    pg: str = ""  # process-group key (ranks list, name or collective/size)
    pg_ranks: list[int] | None = None
    group_size: int = 0
    nbytes: int = 0
    #: P2P: (direction, peer rank or None, own-side known) per send/recv in this op
    p2p: list[tuple[str, int | None]] = field(default_factory=list)
    phase: str = ""  # fwd / bwd when inside a Titan microbatch range (CPU traces)
    step: int = -1

    @property
    def is_p2p(self) -> bool:
        return self.collective in P2P or bool(self.p2p)

    @property
    def dur(self) -> int:
        return self.end - self.ts


# positions in a comm info sequence (:data:`COMM_FIELDS` order)
_COLL, _IN_N, _OUT_N, _GSIZE, _DTYPE, _PG_NAME, _PG_RANKS, _IN_DIMS, _IN_TYPE = range(
    len(COMM_FIELDS)
)


def _nbytes(info: Sequence[Any], coll: str) -> int:
    n = info[_OUT_N] if coll == "allgather" else info[_IN_N]
    if n is None:
        n = info[_IN_N] or info[_OUT_N]
    dtype = info[_DTYPE]
    if n is None and info[_IN_DIMS]:
        try:
            dims = json.loads(info[_IN_DIMS])
            types = json.loads(info[_IN_TYPE]) if info[_IN_TYPE] else []
            first = dims[0] if dims else []
            n = int(math.prod(first if isinstance(first, list) else [first])) if first else 0
            dtype = types[0] if types else dtype
        except (ValueError, TypeError, IndexError):
            n = 0
    return int(n or 0) * dtype_bytes(dtype)


@lru_cache(maxsize=8192)
def _peer(name: str, own: int | None) -> tuple[str, int | None] | None:
    m = _PEER_RE.search(name)
    if m:
        d, a, arrow, b = m.group(1).lower(), int(m.group(2)), m.group(3), int(m.group(4))
        src, dst = (a, b) if arrow == "->" else (b, a)
        return (d, dst if d == "send" else src)
    m = _TITAN_P2P_RE.search(name)
    if m:
        return (m.group(1), int(m.group(2)))
    low = name.lower()
    if _SEND_RE.search(low) and "recv" not in low:
        return ("send", None)
    if _RECV_RE.search(low):
        return ("recv", None)
    return None


def extract_comm_ops(ev: Events, gpu: GpuEvents, cfg: TraceConfig) -> list[CommOp]:
    """All comm ops of a rank in time order (device kernels, or host ranges if none)."""
    skip = set(cfg.gpu_event_cats) | {GPU_ANNOTATION}
    # matched at the start of the name, as the parser kept them (TraceConfig.is_cpu_comm)
    is_comm = {n: cfg.is_cpu_comm(n) for n in set(ev.host_name)}
    # host ranges as (ts, end, name, tid, info) rows
    host: list[_HostRow] = []
    titan: list[_HostRow] = []
    for ts, end, name, tid, info, cat in zip(
        ev.host_ts, ev.host_end, ev.host_name, ev.host_tid, ev.host_info, ev.host_cat, strict=True
    ):
        if is_comm[name] and cat not in skip:
            host.append((ts, end, name, tid, info))
        if name.startswith("titan/"):
            titan.append((ts, end, name, tid, info))
    host.sort(key=_FIRST)
    comm_code = KIND_CODE["communication"]
    kernels = [i for i, k in enumerate(gpu.kind) if k == comm_code]
    if kernels:
        return _from_kernels(gpu, kernels, host, titan)
    return _from_host([_row(*r) for r in host], [_row(*r) for r in titan])


_HostRow = tuple[int, int, str, Any, "tuple | None"]
_FIRST = itemgetter(0)


def _row(ts: int, end: int, name: str, tid: Any, info: tuple | None) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "ts": ts, "end": end, "tid": tid, "_args": info}
    if info is None:
        row.update(_NO_INFO)
    else:
        row.update(zip(COMM_FIELDS, info, strict=True))
    return row


_NO_INFO = dict.fromkeys(COMM_FIELDS)
_TS = itemgetter("ts")

_NO_INFO_LIST = [None] * len(COMM_FIELDS)
_ALL_FIELDS = range(len(COMM_FIELDS))


def _from_kernels(
    gpu: GpuEvents, kernels: list[int], host: list[_HostRow], titan: list[_HostRow]
) -> list[CommOp]:
    by_tid: dict[Any, list[_HostRow]] = {}
    for row in sorted(host + titan, key=_FIRST):
        by_tid.setdefault(row[3], []).append(row)
    starts = {t: [r[0] for r in rows] for t, rows in by_tid.items()}
    last_launch: dict[Any, int] = {}
    ops = []
    for i, tid in zip(kernels, gpu.launch_threads(kernels), strict=True):
        name = gpu.name[i]
        coll_k, algo = collective_from_kernel(name)
        own = gpu.info[i]
        info = list(_NO_INFO_LIST if own is None else own)
        p2p: list[tuple[str, int | None]] = []
        lts = gpu.launch_ts[i]
        if tid in by_tid and lts is not None:
            hrows, hs = by_tid[tid], starts[tid]
            lo = last_launch.get(tid, -1)
            i1 = bisect_right(hs, lts)
            # host ranges that enclose the launch give the op's args and name
            for _, r_end, r_name, _, r_info in reversed(hrows[max(0, i1 - 8) : i1]):
                if r_end >= lts:
                    # the innermost range with a field sets it (no info: all None)
                    if r_info is not None and None in info:
                        for j in _ALL_FIELDS:
                            if info[j] is None:
                                info[j] = r_info[j]
                    if info[_COLL] is None and ":" in r_name:
                        info[_COLL] = r_name
            # P2P: the send/recv ranges issued since the previous comm launch (coalesced too)
            if coll_k in P2P or coll_k == "unknown":
                i0 = bisect_right(hs, lo)
                for r in hrows[i0:i1]:
                    p = _peer(r[2], None)
                    if p is not None and not (p[1] is None and any(q[1] is not None for q in p2p)):
                        p2p.append(p)
                p2p = _dedupe(p2p)
            last_launch[tid] = lts
        ops.append(_make_op(gpu.ts[i], gpu.end[i], info, coll_k, algo, p2p))
    return ops


def _dedupe(p2p: list[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    """Nested ranges (c10d::send > record_param_comms > nccl:send 0->1) name one op once."""
    known = [p for p in p2p if p[1] is not None]
    if known:
        return known
    out: list[tuple[str, int | None]] = []
    for p in p2p:
        if p not in out:
            out.append(p)
    return out


def _make_op(ts: int, end: int, info: Sequence[Any], coll_k: str, algo: str, p2p: list) -> CommOp:
    coll = normalize_collective(info[_COLL]) if info[_COLL] else coll_k
    if coll in ("sendrecv", "send", "recv") and not p2p:
        p2p = []
    ranks, pg = _group(info[_PG_RANKS])
    if pg is None:
        pg = f"pg{info[_PG_NAME]}" if info[_PG_NAME] else f"{coll}/{info[_GSIZE] or 0}"
    # positional: keyword arguments cost a dataclass __init__ about twice the time
    return CommOp(
        int(ts),
        int(end),
        coll,
        algo,
        pg,
        None if ranks is None else list(ranks),
        int(info[_GSIZE] or (len(ranks) if ranks else 0)),
        _nbytes(info, coll),
        p2p,
    )


@lru_cache(maxsize=4096)
def _group(text: str | None) -> tuple[tuple[int, ...] | None, str | None]:
    """A group's member ranks (from the args' JSON text, possibly encoded twice) and its
    key, when it has any."""
    if not text:
        return None, None
    try:
        val = json.loads(text)
        if isinstance(val, str):
            val = json.loads(val)
        ranks = tuple(int(x) for x in val) if isinstance(val, list) else None
    except (ValueError, TypeError):
        ranks = None
    return ranks, (str(list(ranks)) if ranks else None)


def _from_host(host: list[dict[str, Any]], titan: list[dict[str, Any]]) -> list[CommOp]:
    """CPU-only traces: the outermost host comm range of each nest is one op."""
    mbs = sorted((r for r in titan if _MB_RE.search(r["name"])), key=_TS)
    mb_ts = [r["ts"] for r in mbs]
    mb_end = [r["end"] for r in mbs]
    mb_names = [r["name"] for r in mbs]
    p2p_ranges = [r for r in titan if _TITAN_P2P_RE.search(r["name"])]
    rows = sorted(host + p2p_ranges, key=_TS)
    ops: list[CommOp] = []
    i = 0
    while i < len(rows):
        top = rows[i]
        info = dict(top)
        names = [top["name"]]
        j = i + 1
        while j < len(rows) and rows[j]["ts"] <= top["end"] and rows[j]["tid"] == top["tid"]:
            names.append(rows[j]["name"])
            for key in COMM_FIELDS:
                if info.get(key) is None and rows[j].get(key) is not None:
                    info[key] = rows[j][key]
            j += 1
        p2p = _dedupe([p for p in (_peer(n, None) for n in names) if p is not None])
        coll_name = next((n for n in names if ":" in n and not n.startswith("titan/")), names[0])
        info.setdefault("coll", None)
        if info["coll"] is None:
            info["coll"] = coll_name
        coll = normalize_collective(info["coll"])
        if p2p and coll not in P2P:
            coll = p2p[0][0] if len(p2p) == 1 else "sendrecv"
        op = _make_op(top["ts"], top["end"], [info[k] for k in COMM_FIELDS], coll, "", p2p)
        k = bisect_right(mb_ts, top["ts"]) - 1
        if k >= 0 and top["ts"] < mb_end[k]:
            m = _MB_RE.search(mb_names[k])
            op.phase = m.group(1) if m else ""
        ops.append(op)
        i = j
    return ops
