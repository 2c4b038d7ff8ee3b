"""Per-rank analysis: steps, kernel breakdown, time breakdown per step, idle split.

Runs right after parsing (in the same worker when there are several), and returns a
compact, picklable :class:`RankResult` so that the events of a rank never leave it.
Plain Python over the parsed columns: no numpy, no polars.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq, gt, le, lt, sub
from typing import Any

from titan_core.trace import intervals as iv
from titan_core.trace.categories import GPU_ANNOTATION, KIND_CODE, KINDS, TraceConfig
from titan_core.trace.columns import Events, RankTrace
from titan_core.trace.comm import CommOp, extract_comm_ops
from titan_core.trace.device_events import GpuEvents, gpu_events

_STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")
#: ``record_function`` ranges Titan emits per microbatch: titan/microbatch/fwd/mb3/vs0
MICROBATCH_RE = re.compile(r"^titan/microbatch/(fwd|bwd)/mb(\d+)(?:/vs(\d+))?")
#: RL step phases titan_rl.grpo emits: titan/rl/rollout, titan/rl/train, titan/rl/sync
RL_PHASE_PREFIX = "titan/rl/"


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
    #: first computation start and last computation end inside the window (None: none)
    compute_span: tuple[int, int] | None = None
    #: RL phase -> microseconds inside this step (titan/rl/<phase> ranges)
    phases: dict[str, int] = field(default_factory=dict)


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
    compute_coarse: tuple[list[int], list[int]]
    n_events: int
    warnings: list[str] = field(default_factory=list)


def profiler_steps(ev: Events) -> list[tuple[int, int, int]]:
    """(step number, start, end) of the host's ``ProfilerStep#N`` ranges, in time order
    (their device-stream mirrors are the same steps, not more)."""
    out = []
    for name, cat, ts, end in zip(ev.host_name, ev.host_cat, ev.host_ts, ev.host_end, strict=True):
        if name.startswith("ProfilerStep") and cat != GPU_ANNOTATION:
            m = _STEP_RE.match(name)
            if m:
                out.append((int(m.group(1)), ts, end))
    out.sort(key=lambda r: r[1])
    return out


def analyze_rank(rt: RankTrace, cfg: TraceConfig, rank: int) -> RankResult:
    """Everything the cross-rank analyses need from one rank."""
    ev = rt.events
    steps = profiler_steps(ev)
    gpu = gpu_events(ev, cfg)

    sets, kernel_time, kernel_counts = _kernel_sets(gpu, steps)
    compute_stream = "gpu" if len(gpu) else "cpu"
    top_kernels = _top_kernels(gpu, cfg.top_kernels)

    comm_ops = extract_comm_ops(ev, gpu, cfg)
    if compute_stream == "cpu":
        sets = _cpu_sets(ev, cfg, comm_ops, steps)
    mbs = _microbatches(ev, gpu)
    step_stats = _step_stats(steps, gpu, sets, cfg, mbs)
    _assign_phases(ev, steps, step_stats)
    _assign_steps(comm_ops, step_stats)
    comp = sets[0]
    if len(comp[0]):  # close <20us gaps
        coarse = iv.merge(comp[0], [e + 20 for e in comp[1]])
        coarse = (coarse[0], [max(s, e - 20) for s, e in zip(*coarse, strict=True)])
    else:
        coarse = comp
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
        compute_coarse=coarse,
        n_events=ev.n_events,
        warnings=list(rt.warnings),
    )


_KIND_NAMES = {v: k for k, v in KIND_CODE.items()}


def _top_kernels(gpu: GpuEvents, n: int) -> list[dict[str, Any]]:
    # a kernel's kind follows from its name, so the name alone is the key
    durations: defaultdict[str, list[int]] = defaultdict(list)
    for name, d in zip(gpu.name, map(sub, gpu.end, gpu.ts), strict=True):
        durations[name].append(d)
    kind_of = dict(zip(gpu.name, gpu.kind, strict=True))
    totals = sorted(((sum(d), name) for name, d in durations.items()), key=lambda r: -r[0])[:n]
    return [
        {
            "name": name,
            "kind": _KIND_NAMES[kind_of[name]],
            "count": len(durations[name]),
            "sum_us": total,
            "max_us": max(durations[name]),
            "min_us": min(durations[name]),
        }
        for total, name in totals
    ]


def _kernel_sets(
    gpu: GpuEvents, steps: list[tuple[int, int, int]]
) -> tuple[list[iv.Intervals], dict[str, int], dict[str, int]]:
    """Per category (:data:`KINDS`): the union of its kernels' intervals, and the
    breakdown: that union's length over the profiled steps, and the kernels counted.

    As HTA counts the breakdown: with two or more profiler steps, only device events
    launched before the last step starts (the last step is usually cut short) by a host
    event; otherwise all. Those are nearly always the first ones by start (then both
    unions come from one sweep)."""
    last_start = max(s[1] for s in steps) if len(steps) >= 2 else None
    sets, times, counts = [], {}, {}
    for k in KINDS:
        mask = list(map(eq, gpu.kind, repeat(KIND_CODE[k])))
        ts, end = list(compress(gpu.ts, mask)), list(compress(gpu.end, mask))
        if last_start is None:
            merged = iv.merge(ts, end)
            times[k], counts[k] = iv.total(merged), len(ts)
            sets.append(merged)
            continue
        launched = list(compress(gpu.launch_ts, mask))
        if None in launched:
            counted = [x is not None and x < last_start for x in launched]
        else:
            counted = list(map(lt, launched, repeat(last_start)))
        n = counted.index(False) if False in counted else len(counted)
        if True in counted[n:]:  # not a prefix: a union of its own
            merged = iv.merge(ts, end)
            times[k] = iv.total(iv.merge(list(compress(ts, counted)), list(compress(end, counted))))
        else:
            merged, times[k] = iv.merge_with_prefix(ts, end, n)
        counts[k] = sum(counted)
        sets.append(merged)
    return sets, times, counts


def _union(gpu: GpuEvents, sets: list[iv.Intervals]) -> iv.Intervals:
    """Union of the sets; on GPU straight from the start-sorted events (no sort)."""
    if not len(gpu):
        return iv.merge([t for s in sets for t in s[0]], [t for s in sets for t in s[1]])
    codes = {KIND_CODE[k] for k in KINDS[: len(sets)]}
    if codes.issuperset(gpu.kind):
        return iv.merge(gpu.ts, gpu.end)
    keep = list(map(codes.__contains__, gpu.kind))
    return iv.merge(list(compress(gpu.ts, keep)), list(compress(gpu.end, keep)))


def _cpu_sets(
    ev: Events, cfg: TraceConfig, comm_ops: list[CommOp], steps: list[tuple[int, int, int]]
) -> list[iv.Intervals]:
    """Compute stream of a CPU-only trace: Titan's microbatch ranges when present, else
    the CPU ops of the main thread (the one running the profiler steps), minus comm."""
    comm = iv.merge([o.ts for o in comm_ops], [o.end for o in comm_ops])
    mb_s, mb_e = [], []
    for name, ts, end in zip(ev.host_name, ev.host_ts, ev.host_end, strict=True):
        if MICROBATCH_RE.search(name):
            mb_s.append(ts)
            mb_e.append(end)
    if mb_s:
        raw = iv.merge(mb_s, mb_e)
    else:
        main = None
        st = [
            t
            for n, c, t in zip(ev.host_name, ev.host_cat, ev.host_tid, strict=True)
            if n.startswith("ProfilerStep") and c != GPU_ANNOTATION
        ]
        if st:
            main = Counter(st).most_common(1)[0][0]
        elif len(ev.ops_ts):
            busy: dict[str, int] = {}
            for t, s, e in zip(ev.ops_tid, ev.ops_ts, ev.ops_end, strict=True):
                busy[t] = busy.get(t, 0) + (e - s)
            main = max(busy, key=busy.__getitem__)
        if main is not None:
            sel = [i for i, t in enumerate(ev.ops_tid) if t == main]
            raw = iv.merge([ev.ops_ts[i] for i in sel], [ev.ops_end[i] for i in sel])
        else:
            raw = iv.merge(ev.ops_ts, ev.ops_end)
    compute = iv.subtract(raw, comm)
    return [compute, comm, ([], [])]


def _assign_phases(
    ev: Events, host_steps: list[tuple[int, int, int]], steps: list[StepStats]
) -> None:
    """Sum each step's ``titan/rl/<phase>`` host ranges (the RL loop's rollout/train/sync;
    not their device-stream mirrors) by the host's ``ProfilerStep`` range holding their
    start: both are host times, whereas a GPU trace's step window is the device's. Without
    profiler steps, the one step the whole trace is."""
    by_number = {s.step: s for s in steps}
    if not by_number:
        return
    if not host_steps:
        host_steps = [(s.step, s.start, s.end) for s in steps]
    starts = [s for _, s, _ in host_steps]
    for name, cat, ts, end in zip(ev.host_name, ev.host_cat, ev.host_ts, ev.host_end, strict=True):
        if not name.startswith(RL_PHASE_PREFIX) or cat == GPU_ANNOTATION:
            continue
        i = bisect_left(starts, ts + 1) - 1
        if i < 0 or ts >= host_steps[i][2]:
            continue
        step = by_number.get(host_steps[i][0])
        if step is not None:
            phase = name[len(RL_PHASE_PREFIX) :]
            step.phases[phase] = step.phases.get(phase, 0) + int(end - ts)


def _microbatches(ev: Events, gpu: GpuEvents) -> list[tuple[str, int, int, int, int]]:
    """(phase, microbatch, virtual stage, start, end) of Titan's microbatch ranges; on GPU
    traces mapped to the span of the kernels they launched."""
    mb = []
    for name, cat, ts, end in zip(ev.host_name, ev.host_cat, ev.host_ts, ev.host_end, strict=True):
        if cat != GPU_ANNOTATION:
            m = MICROBATCH_RE.match(name)
            if m:
                mb.append((ts, m, end))
    if not mb:
        return []
    mb.sort(key=lambda x: x[0])
    lt = sorted((x, i) for i, x in enumerate(gpu.launch_ts) if x is not None)
    lts = [x for x, _ in lt]
    out = []
    for ts, m, end in mb:
        s, e = ts, end
        if lts:
            i0, i1 = bisect_left(lts, ts), bisect_left(lts, end)
            if i1 > i0:
                sel = [i for _, i in lt[i0:i1]]
                s = min(gpu.ts[i] for i in sel)
                e = max(gpu.end[i] for i in sel)
        out.append((m.group(1), int(m.group(2)), int(m.group(3) or 0), s, e))
    return out


def _step_windows(steps: list[tuple[int, int, int]], gpu: GpuEvents) -> list[tuple[int, int, int]]:
    """Step windows on the compute stream's clock. On GPU: from the first device event
    launched in the step to the first one of the next step (the last: to its last end)."""
    if not len(gpu) or not steps:
        return steps
    ts, end, lts = gpu.ts, gpu.end, gpu.launch_ts
    # each event's launch time (its own start without one), and the events in that order
    keys = lts if None not in lts else [t if x is None else x for x, t in zip(lts, ts, strict=True)]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    sorted_keys = list(map(keys.__getitem__, order))
    firsts: list[tuple[int, int] | None] = []
    for _, s, e in steps:
        i0, i1 = bisect_left(sorted_keys, s), bisect_left(sorted_keys, e)
        if i1 > i0:
            sel = order[i0:i1]  # indices into the start-sorted events: the lowest starts first
            firsts.append((ts[min(sel)], max(map(end.__getitem__, sel))))
        else:
            firsts.append(None)
    out = []
    for i, (n, _, _) in enumerate(steps):
        f = firsts[i]
        if f is None:
            continue
        nxt = next((x for x in firsts[i + 1 :] if x is not None), None)
        hi = nxt[0] if nxt is not None else f[1]
        out.append((n, f[0], max(hi, f[0] + 1)))
    return out


def _step_stats(
    steps: list[tuple[int, int, int]],
    gpu: GpuEvents,
    sets: list[iv.Intervals],
    cfg: TraceConfig,
    mbs: list[tuple[str, int, int, int, int]],
) -> list[StepStats]:
    """Each step's time breakdown; idle time is split by what it waited for on GPU traces
    (on CPU-only ones, all of it is "other")."""
    windows = _step_windows(steps, gpu)
    if not windows:  # no profiler steps: the whole trace is one step
        los = [s[0] for s in sets if len(s[0])]
        his = [s[1][-1] for s in sets if len(s[1])]
        if not los:
            return []
        windows = [(0, int(min(x[0] for x in los)), int(max(his)))]
    # what the steps need of the three sets (computation A, communication B, memory C)
    # are |A|, |B|, |A u B| and |A u B u C|: A n B is |A| + |B| - |A u B|, exposed comm
    # |A u B| - |A|, exposed memory |A u B u C| - |A u B|, idle the window minus the last
    union_all = _union(gpu, sets)
    union_cc = _union(gpu, sets[:2])
    # start -> index of the first device event starting then (built backwards)
    kts = gpu.ts
    first_at = dict(zip(reversed(kts), range(len(kts) - 1, -1, -1), strict=True))
    out = []
    thr = cfg.kernel_wait_threshold_us
    for n, lo, hi in windows:
        comp_in = iv.clip(sets[0], lo, hi)
        comp = iv.total(comp_in)
        comm = iv.total(iv.clip(sets[1], lo, hi))
        either = iv.total(iv.clip(union_cc, lo, hi))
        active = iv.clip(union_all, lo, hi)
        busy = iv.total(active)
        st = StepStats(
            step=n,
            start=lo,
            end=hi,
            computation=comp,
            communication=either - comp,
            memory=busy - either,
            idle=(hi - lo) - busy,
            overlap=comp + comm - either,
            comm_total=comm,
            microbatches=[m for m in mbs if lo <= m[3] < hi],
            compute_span=(comp_in[0][0], comp_in[1][-1]) if comp_in[0] else None,
        )
        gs, ge = iv.gaps(active, lo, hi)
        if len(gpu) and len(gs):
            st.host_wait, st.kernel_wait, st.other_wait = _idle_split(
                gs, ge, kts, gpu.launch_ts, first_at, thr
            )
        else:
            st.other_wait = st.idle
        out.append(st)
    return out


def _idle_split(
    gs: list[int],
    ge: list[int],
    kts: list[int],
    klaunch: list[int | None],
    first_at: dict[int, int],
    thr: int,
) -> tuple[int, int, int]:
    """Split idle gaps [gs, ge) by what the device event ending each (the first to start
    at or after its end) waited for: launched after the gap began, the host (host wait);
    else, for gaps up to ``thr`` us, the previous kernel (kernel wait); else other (also
    gaps with no event after them). ``first_at``: start -> index of the first device event
    starting then; gaps end at one, but for the last (else found by bisection)."""
    lens = list(map(sub, ge, gs))
    nxt = list(map(first_at.get, ge))
    if nxt[-1] is None:  # the last gap may end at the window's end
        nxt[-1] = bisect_left(kts, ge[-1])
    if None in nxt:
        nxt = [bisect_left(kts, b) if i is None else i for i, b in zip(nxt, ge, strict=True)]
    n = bisect_left(nxt, len(kts))  # the gaps before that end at an event's start
    launched = list(map(klaunch.__getitem__, nxt[:n]))
    if None in launched:  # no launch: never host wait
        launched = [-1 if x is None else x for x in launched]
    host = list(map(gt, launched, gs))
    host_w = sum(compress(lens, host))
    # kernel wait: not host wait (False < True) and short
    kern_w = sum(compress(lens, map(lt, host, map(le, lens, repeat(thr)))))
    return host_w, kern_w, sum(lens) - host_w - kern_w


def _assign_steps(ops: list[CommOp], steps: list[StepStats]) -> None:
    if not steps:
        return
    starts = [s.start for s in steps]
    for op in ops:
        i = bisect_right(starts, op.ts) - 1
        if i >= 0 and op.ts < steps[i].end:
            op.step = steps[i].step
