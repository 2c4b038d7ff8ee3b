"""Per-rank analysis: steps, kernel breakdown, time breakdown per step, idle split.

Runs in a worker process right after parsing, and returns a compact, picklable
:class:`RankResult` so that the events of a rank never leave its worker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from titan_core.trace import intervals as iv
from titan_core.trace.categories import KIND_CODE, KINDS, TraceConfig
from titan_core.trace.comm import CommOp, extract_comm_ops
from titan_core.trace.parse import RankTrace

_STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")
#: ``record_function`` ranges Titan emits per microbatch: titan/microbatch/fwd/mb3/vs0
MICROBATCH_RE = re.compile(r"^titan/microbatch/(fwd|bwd)/mb(\d+)(?:/vs(\d+))?")


@dataclass
class StepStats:
    step: int
    start: int
    end: int
    computation: int = 0
    communication: int = 0  # exposed: comm running, no computation
    memory: int = 0  # exposed: copies only
    idle: int = 0
    overlap: int = 0  # computation and communication at once
    comm_total: int = 0
    host_wait: int = 0
    kernel_wait: int = 0
    other_wait: int = 0
    microbatches: list[tuple[str, int, int, int, int]] = field(default_factory=list)


@dataclass
class RankResult:
    rank: int
    path: str
    meta: dict[str, Any]
    compute_stream: str  # "gpu" or "cpu"
    kernel_time_us: dict[str, int]
    kernel_counts: dict[str, int]
    steps: list[StepStats]
    top_kernels: list[dict[str, Any]]
    comm_ops: list[CommOp]
    #: merged compute-busy intervals (coarsened) for timelines: (starts, ends)
    compute_coarse: tuple[np.ndarray, np.ndarray]
    n_events: int
    warnings: list[str] = field(default_factory=list)


def profiler_steps(ev: pl.DataFrame) -> list[tuple[int, int, int]]:
    """(step number, start, end) of the ``ProfilerStep#N`` ranges, in time order."""
    ps = ev.filter(pl.col("name").cast(pl.String).str.starts_with("ProfilerStep")).select(
        "name", "ts", "end"
    )
    out = []
    for name, ts, end in ps.iter_rows():
        m = _STEP_RE.match(name)
        if m:
            out.append((int(m.group(1)), ts, end))
    out.sort(key=lambda r: r[1])
    return out


def _kinds(names: pl.Series, cfg: TraceConfig) -> pl.Series:
    if names.len() == 0:
        return pl.Series("kind", [], dtype=pl.Int8)
    uniq = names.unique()
    mapping = {n: KIND_CODE[cfg.kernel_kind(n)] for n in uniq.cast(pl.String).to_list()}
    return names.cast(pl.String).replace_strict(mapping, return_dtype=pl.Int8)


def analyze_rank(rt: RankTrace, cfg: TraceConfig, rank: int) -> RankResult:
    """Everything the cross-rank analyses need from one rank."""
    ev = rt.events
    steps = profiler_steps(ev)
    gpu = ev.filter(pl.col("cat").cast(pl.String).is_in(cfg.gpu_event_cats))
    gpu = gpu.with_columns(kind=_kinds(gpu["name"], cfg))
    # the host event that launched each device event (same correlation id)
    launch = (
        ev.filter(
            (pl.col("corr") >= 0)
            & (pl.col("stream") < 0)
            & ~pl.col("cat").cast(pl.String).is_in(cfg.gpu_event_cats)
        )
        .group_by("corr")
        .agg(launch_ts=pl.col("ts").min(), launch_tid=pl.col("tid").first())
    )
    gpu = gpu.join(launch, on="corr", how="left").sort("ts")

    kernel_time, kernel_counts = _kernel_time(gpu, steps)
    compute_stream = "gpu" if gpu.height else "cpu"

    top = (
        gpu.group_by("name", "kind")
        .agg(
            count=pl.len(),
            sum_us=(pl.col("end") - pl.col("ts")).sum(),
            max_us=(pl.col("end") - pl.col("ts")).max(),
            min_us=(pl.col("end") - pl.col("ts")).min(),
        )
        .sort("sum_us", descending=True)
        .head(cfg.top_kernels)
    )
    kind_names = {v: k for k, v in KIND_CODE.items()}
    top_kernels = [
        {
            "name": r["name"],
            "kind": kind_names[r["kind"]],
            "count": r["count"],
            "sum_us": r["sum_us"],
            "max_us": r["max_us"],
            "min_us": r["min_us"],
        }
        for r in top.with_columns(pl.col("name").cast(pl.String)).iter_rows(named=True)
    ]

    comm_ops = extract_comm_ops(ev, gpu, cfg)
    if compute_stream == "gpu":
        sets, launch_of = _gpu_sets(gpu)
    else:
        sets, launch_of = _cpu_sets(rt, cfg, comm_ops, steps), None
    mbs = _microbatches(ev, gpu)
    step_stats = _step_stats(steps, gpu, sets, launch_of, cfg, mbs)
    _assign_steps(comm_ops, step_stats)
    comp = sets[0]
    coarse = iv.merge(comp[0], comp[1] + 20) if len(comp[0]) else comp  # close <20us gaps
    return RankResult(
        rank=rank,
        path=rt.path,
        meta=rt.meta,
        compute_stream=compute_stream,
        kernel_time_us=kernel_time,
        kernel_counts=kernel_counts,
        steps=step_stats,
        top_kernels=top_kernels,
        comm_ops=comm_ops,
        compute_coarse=(coarse[0], np.maximum(coarse[0], coarse[1] - 20)),
        n_events=ev.height + rt.cpu_ops.height,
        warnings=list(rt.warnings),
    )


def _kernel_time(gpu: pl.DataFrame, steps: list[tuple[int, int, int]]) -> tuple[dict, dict]:
    """Union of kernel intervals per category over the profiled steps.

    As HTA counts it: with two or more profiler steps, only device events launched before
    the last step starts (the last step is usually cut short) by a host event; otherwise all.
    """
    sel = gpu
    if len(steps) >= 2:
        last_start = max(s[1] for s in steps)
        sel = gpu.filter(pl.col("launch_ts").is_not_null() & (pl.col("launch_ts") < last_start))
    out, counts = {}, {}
    for kind in KINDS:
        k = sel.filter(pl.col("kind") == KIND_CODE[kind])
        out[kind] = iv.total(iv.merge(k["ts"].to_numpy(), k["end"].to_numpy()))
        counts[kind] = k.height
    return out, counts


def _gpu_sets(gpu: pl.DataFrame) -> tuple[list[iv.Intervals], Any]:
    sets = []
    for kind in KINDS:
        k = gpu.filter(pl.col("kind") == KIND_CODE[kind])
        sets.append(iv.merge(k["ts"].to_numpy(), k["end"].to_numpy()))
    ts = gpu["ts"].to_numpy()
    launch = gpu["launch_ts"].fill_null(-1).to_numpy()
    return sets, (ts, launch)


def _cpu_sets(
    rt: RankTrace, cfg: TraceConfig, comm_ops: list[CommOp], steps: list[tuple[int, int, int]]
) -> list[iv.Intervals]:
    """Compute stream of a CPU-only trace: Titan's microbatch ranges when present, else
    the CPU ops of the main thread (the one running the profiler steps), minus comm."""
    ev = rt.events
    comm = iv.merge(
        np.array([o.ts for o in comm_ops], dtype=np.int64),
        np.array([o.end for o in comm_ops], dtype=np.int64),
    )
    mb = ev.filter(pl.col("name").cast(pl.String).str.contains(MICROBATCH_RE.pattern))
    if mb.height:
        raw = iv.merge(mb["ts"].to_numpy(), mb["end"].to_numpy())
    else:
        ops = rt.cpu_ops
        main = None
        st = ev.filter(pl.col("name").cast(pl.String).str.starts_with("ProfilerStep"))
        if st.height:
            main = st["tid"].cast(pl.String).mode().to_list()[0]
        elif ops.height:
            main = (
                ops.group_by(pl.col("tid").cast(pl.String))
                .agg(t=(pl.col("end") - pl.col("ts")).sum())
                .sort("t", descending=True)["tid"][0]
            )
        ops = ops.filter(pl.col("tid").cast(pl.String) == main) if main is not None else ops
        raw = iv.merge(ops["ts"].to_numpy(), ops["end"].to_numpy())
    compute = iv.subtract(raw, comm)
    empty = (np.empty(0, np.int64), np.empty(0, np.int64))
    return [compute, comm, empty]


def _microbatches(ev: pl.DataFrame, gpu: pl.DataFrame) -> list[tuple[str, int, int, int, int]]:
    """(phase, microbatch, virtual stage, start, end) of Titan's microbatch ranges; on GPU
    traces mapped to the span of the kernels they launched."""
    mb = ev.filter(
        pl.col("name").cast(pl.String).str.contains(MICROBATCH_RE.pattern)
        & (pl.col("cat").cast(pl.String) != "gpu_user_annotation")
    ).sort("ts")
    out = []
    lt = gpu.filter(pl.col("launch_ts").is_not_null()).sort("launch_ts") if gpu.height else None
    for name, ts, end in mb.select(pl.col("name").cast(pl.String), "ts", "end").iter_rows():
        m = MICROBATCH_RE.match(name)
        assert m is not None
        s, e = ts, end
        if lt is not None and lt.height:
            lts = lt["launch_ts"].to_numpy()
            i0, i1 = np.searchsorted(lts, ts), np.searchsorted(lts, end)
            if i1 > i0:
                s = int(lt["ts"][i0:i1].min())
                e = int(lt["end"][i0:i1].max())
        out.append((m.group(1), int(m.group(2)), int(m.group(3) or 0), s, e))
    return out


def _step_windows(
    steps: list[tuple[int, int, int]], gpu: pl.DataFrame
) -> list[tuple[int, int, int]]:
    """Step windows on the compute stream's clock. On GPU: from the first device event
    launched in the step to the first one of the next step (the last: to its last end)."""
    if not gpu.height or not steps:
        return steps
    lts = gpu["launch_ts"].fill_null(gpu["ts"]).to_numpy()
    ts = gpu["ts"].to_numpy()
    end = gpu["end"].to_numpy()
    firsts = []
    for _, s, e in steps:
        m = (lts >= s) & (lts < e)
        firsts.append((int(ts[m].min()), int(end[m].max())) if m.any() else None)
    out = []
    for i, (n, _, _) in enumerate(steps):
        if firsts[i] is None:
            continue
        nxt = next((f for f in firsts[i + 1 :] if f is not None), None)
        hi = nxt[0] if nxt is not None else firsts[i][1]
        out.append((n, firsts[i][0], max(hi, firsts[i][0] + 1)))
    return out


def _step_stats(
    steps: list[tuple[int, int, int]],
    gpu: pl.DataFrame,
    sets: list[iv.Intervals],
    launch_of: Any,
    cfg: TraceConfig,
    mbs: list[tuple[str, int, int, int, int]],
) -> list[StepStats]:
    windows = _step_windows(steps, gpu)
    if not windows:  # no profiler steps: the whole trace is one step
        los = [s[0] for s in sets if len(s[0])]
        his = [s[1][-1] for s in sets if len(s[1])]
        if not los:
            return []
        windows = [(0, int(min(x[0] for x in los)), int(max(his)))]
    union_all = iv.merge(np.concatenate([s[0] for s in sets]), np.concatenate([s[1] for s in sets]))
    out = []
    thr = cfg.kernel_wait_threshold_us
    for n, lo, hi in windows:
        clipped = [iv.clip(s, lo, hi) for s in sets]
        cov = iv.coverage(clipped)
        idx = np.arange(len(cov))
        comp = int(cov[(idx & 1) > 0].sum())
        comm_exposed = int(cov[((idx & 2) > 0) & ((idx & 1) == 0)].sum())
        mem_exposed = int(cov[idx == 4].sum())
        busy = int(cov.sum())
        st = StepStats(
            step=n,
            start=lo,
            end=hi,
            computation=comp,
            communication=comm_exposed,
            memory=mem_exposed,
            idle=(hi - lo) - busy,
            overlap=int(cov[(idx & 3) == 3].sum()),
            comm_total=iv.total(clipped[1]),
            microbatches=[m for m in mbs if lo <= m[3] < hi],
        )
        gs, ge = iv.gaps(iv.clip(union_all, lo, hi), lo, hi)
        if launch_of is not None and len(gs):
            kts, klaunch = launch_of
            j = np.searchsorted(kts, ge, side="left")
            has_next = j < len(kts)
            nxt_launch = np.where(has_next, klaunch[np.minimum(j, len(kts) - 1)], -1)
            length = ge - gs
            host = has_next & (nxt_launch > gs)
            kern = ~host & has_next & (length <= thr)
            st.host_wait = int(length[host].sum())
            st.kernel_wait = int(length[kern].sum())
            st.other_wait = int(length.sum()) - st.host_wait - st.kernel_wait
        else:
            st.other_wait = st.idle
        out.append(st)
    return out


def _assign_steps(ops: list[CommOp], steps: list[StepStats]) -> None:
    if not steps:
        return
    starts = np.array([s.start for s in steps])
    for op in ops:
        i = int(np.searchsorted(starts, op.ts, side="right")) - 1
        if i >= 0 and op.ts < steps[i].end:
            op.step = steps[i].step
