"""Communication ops of one rank: collectives and P2P, with sizes, groups and peers.

A comm op is a device comm kernel (NCCL/RCCL/HCCL/MCCL) or, in CPU-only traces, a host
comm range (``gloo:send``, ``c10d::recv_``...). What it is comes from the kernel's own args
(newer PyTorch), else from the host ranges around its launch: ``record_param_comms`` args,
``nccl:all_reduce`` names, ``nccl:send 0->1`` / ``nccl:recv 1<-0`` for P2P peers, or
Titan's ``titan/p2p/{send|recv}/peer{R}`` ranges.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from titan_core.trace.categories import (
    KIND_CODE,
    TraceConfig,
    collective_from_kernel,
    dtype_bytes,
    normalize_collective,
)

P2P = {"send", "recv", "sendrecv"}
_PEER_RE = re.compile(r"(send|recv)\D*?(\d+)\s*(->|<-)\s*(\d+)", re.I)
_TITAN_P2P_RE = re.compile(r"titan/p2p/(send|recv)/peer(\d+)")
_MB_RE = re.compile(r"titan/microbatch/(fwd|bwd)")


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


def _ranks(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        val = json.loads(text)
        if isinstance(val, str):
            val = json.loads(val)
        return [int(x) for x in val] if isinstance(val, list) else None
    except (ValueError, TypeError):
        return None


def _nbytes(row: dict[str, Any], coll: str) -> int:
    n = row.get("out_n") if coll == "allgather" else row.get("in_n")
    if n is None:
        n = row.get("in_n") or row.get("out_n")
    dtype = row.get("dtype")
    if n is None and row.get("in_dims"):
        try:
            dims = json.loads(row["in_dims"])
            types = json.loads(row["in_type"]) if row.get("in_type") else []
            first = dims[0] if dims else []
            n = int(np.prod(first)) if first else 0
            dtype = types[0] if types else dtype
        except (ValueError, TypeError, IndexError):
            n = 0
    return int(n or 0) * dtype_bytes(dtype)


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
    if re.search(r"(^|[:_])send", low) and "recv" not in low:
        return ("send", None)
    if re.search(r"(^|[:_])recv", low):
        return ("recv", None)
    return None


def extract_comm_ops(ev: pl.DataFrame, gpu: pl.DataFrame, cfg: TraceConfig) -> list[CommOp]:
    """All comm ops of a rank in time order (device kernels, or host ranges if none)."""
    host = ev.filter(
        pl.col("name").cast(pl.String).str.contains("|".join(cfg.cpu_comm_patterns))
        & ~pl.col("cat").cast(pl.String).is_in(cfg.gpu_event_cats + ["gpu_user_annotation"])
    ).with_columns(pl.col("name").cast(pl.String), pl.col("tid").cast(pl.String))
    host = host.sort("ts")
    titan = ev.filter(pl.col("name").cast(pl.String).str.starts_with("titan/")).with_columns(
        pl.col("name").cast(pl.String), pl.col("tid").cast(pl.String)
    )
    kernels = gpu.filter(pl.col("kind") == KIND_CODE["communication"]) if gpu.height else gpu
    if kernels.height:
        return _from_kernels(kernels, host, titan)
    return _from_host(host, titan)


def _from_kernels(kernels: pl.DataFrame, host: pl.DataFrame, titan: pl.DataFrame) -> list[CommOp]:
    by_tid: dict[str, list[dict[str, Any]]] = {}
    for row in pl.concat([host, titan], how="vertical_relaxed").sort("ts").iter_rows(named=True):
        by_tid.setdefault(row["tid"], []).append(row)
    starts = {t: np.array([r["ts"] for r in rows]) for t, rows in by_tid.items()}
    last_launch: dict[str, int] = {}
    ops = []
    rows = kernels.with_columns(
        pl.col("name").cast(pl.String), pl.col("launch_tid").cast(pl.String)
    )
    for k in rows.sort("ts").iter_rows(named=True):
        coll_k, algo = collective_from_kernel(k["name"])
        info: dict[str, Any] = dict(k)
        p2p: list[tuple[str, int | None]] = []
        tid, lts = k.get("launch_tid"), k.get("launch_ts")
        if tid in by_tid and lts is not None:
            hrows, hs = by_tid[tid], starts[tid]
            lo = last_launch.get(tid, -1)
            i1 = int(np.searchsorted(hs, lts, side="right"))
            # host ranges that enclose the launch give the op's args and name
            for r in reversed(hrows[max(0, i1 - 8) : i1]):
                if r["end"] >= lts:
                    for key in (
                        "coll",
                        "in_n",
                        "out_n",
                        "gsize",
                        "dtype",
                        "pg_name",
                        "pg_ranks",
                        "seq",
                        "in_dims",
                        "in_type",
                    ):
                        if info.get(key) is None and r.get(key) is not None:
                            info[key] = r[key]
                    if info.get("coll") is None and ":" in r["name"]:
                        info["coll"] = r["name"]
            # P2P: the send/recv ranges issued since the previous comm launch (coalesced too)
            if coll_k in P2P or coll_k == "unknown":
                i0 = int(np.searchsorted(hs, lo, side="right"))
                for r in hrows[i0:i1]:
                    p = _peer(r["name"], None)
                    if p is not None and not (p[1] is None and any(q[1] is not None for q in p2p)):
                        p2p.append(p)
                p2p = _dedupe(p2p)
            last_launch[tid] = lts
        ops.append(_make_op(k["ts"], k["end"], info, coll_k, algo, p2p))
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


def _make_op(ts: int, end: int, info: dict[str, Any], coll_k: str, algo: str, p2p: list) -> CommOp:
    coll = normalize_collective(info["coll"]) if info.get("coll") else coll_k
    if coll in ("sendrecv", "send", "recv") and not p2p:
        p2p = []
    ranks = _ranks(info.get("pg_ranks"))
    pg = (
        str(ranks)
        if ranks
        else (f"pg{info['pg_name']}" if info.get("pg_name") else f"{coll}/{info.get('gsize') or 0}")
    )
    return CommOp(
        ts=int(ts),
        end=int(end),
        collective=coll,
        algo=algo,
        pg=pg,
        pg_ranks=ranks,
        group_size=int(info.get("gsize") or (len(ranks) if ranks else 0)),
        nbytes=_nbytes(info, coll),
        p2p=p2p,
    )


def _from_host(host: pl.DataFrame, titan: pl.DataFrame) -> list[CommOp]:
    """CPU-only traces: the outermost host comm range of each nest is one op."""
    mbs = titan.filter(pl.col("name").str.contains(_MB_RE.pattern)).sort("ts")
    mb_ts, mb_end = mbs["ts"].to_numpy(), mbs["end"].to_numpy()
    mb_names = mbs["name"].to_list()
    p2p_ranges = titan.filter(pl.col("name").str.contains(_TITAN_P2P_RE.pattern))
    rows = list(
        pl.concat([host, p2p_ranges], how="vertical_relaxed").sort("ts").iter_rows(named=True)
    )
    ops: list[CommOp] = []
    i = 0
    while i < len(rows):
        top = rows[i]
        info = dict(top)
        names = [top["name"]]
        j = i + 1
        while j < len(rows) and rows[j]["ts"] <= top["end"] and rows[j]["tid"] == top["tid"]:
            names.append(rows[j]["name"])
            for key in (
                "coll",
                "in_n",
                "out_n",
                "gsize",
                "dtype",
                "pg_name",
                "pg_ranks",
                "seq",
                "in_dims",
                "in_type",
            ):
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
        op = _make_op(top["ts"], top["end"], info, coll, "", p2p)
        k = int(np.searchsorted(mb_ts, top["ts"], side="right")) - 1
        if k >= 0 and top["ts"] < mb_end[k]:
            m = _MB_RE.search(mb_names[k])
            op.phase = m.group(1) if m else ""
        ops.append(op)
        i = j
    return ops
