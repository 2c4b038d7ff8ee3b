"""Pipeline groups, P2P peers, and bubbles per stage beside the schedule's theory.

Groups come from the process groups in the traces (``pg_desc`` naming the pipeline group),
else from Megatron's rank layout (``--pp``; PP is the outermost dimension of the default
``tp-cp-ep-dp-pp`` order, so group g is ranks g, g + W/PP, g + 2W/PP, ...), else from the
P2P traffic itself (connected ranks, ordered by rank).

Bubbles are measured per step over the group's window on the common clock
(:func:`_group_windows`: the windows of successive steps never overlap, although the
ranks' own steps do) and, with Titan's microbatch ranges, over the schedule itself (first
microbatch start to last microbatch end); a stage's bubble is the part of a window in which
it computes nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from titan_core.trace import intervals as iv
from titan_core.trace.breakdown import RankResult
from titan_core.trace.intervals import Intervals, mean, median


def pipeline_groups(results: list[RankResult], pp: int | None = None) -> list[list[int]]:
    ranks = sorted(r.rank for r in results)
    present = set(ranks)
    groups: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for r in results:
        for pg in r.meta.get("pg_config") or []:
            desc = str(pg.get("pg_desc") or "").lower()
            if ("pipeline" in desc or desc.startswith("pp")) and len(pg["ranks"]) > 1:
                t = tuple(pg["ranks"])
                if t not in seen and present & set(t):
                    seen.add(t)
                    groups.append(list(t))
    if groups:
        return groups
    if pp and pp > 1:
        world = max(max(ranks) + 1, max((r.meta.get("world_size") or 0) for r in results))
        stride = world // pp
        return [[g + k * stride for k in range(pp)] for g in range(stride)]
    # from P2P peers
    adj: dict[int, set[int]] = defaultdict(set)
    for r in results:
        for op in r.comm_ops:
            for _, peer in op.p2p:
                if peer is not None and peer != r.rank:
                    adj[r.rank].add(peer)
                    adj[peer].add(r.rank)
    done: set[int] = set()
    for start in sorted(adj):
        if start in done:
            continue
        comp, todo = set(), [start]
        while todo:
            x = todo.pop()
            if x in comp:
                continue
            comp.add(x)
            todo.extend(adj[x] - comp)
        done |= comp
        groups.append(sorted(comp))
    return groups


def resolve_peers(results: list[RankResult], groups: list[list[int]]) -> int:
    """Fill unknown P2P peers from pipeline adjacency and the microbatch phase (forward
    sends go to the next stage, backward sends to the previous one). Returns how many."""
    stage_of = {r: (gi, s) for gi, g in enumerate(groups) for s, r in enumerate(g)}
    n = 0
    for r in results:
        if r.rank not in stage_of:
            continue
        gi, s = stage_of[r.rank]
        g = groups[gi]
        for op in r.comm_ops:
            if not op.p2p or op.phase not in ("fwd", "bwd"):
                continue
            new = []
            for d, peer in op.p2p:
                if peer is None:
                    step = 1 if (d == "send") == (op.phase == "fwd") else -1
                    t = s + step
                    if 0 <= t < len(g):
                        peer = g[t]
                        n += 1
                new.append((d, peer))
            op.p2p = new
    return n


def theoretical_bubble(p: int, m: int | None, v: int = 1) -> dict[str, float | None]:
    """Bubble fraction of a step: 1F1B (p-1)/(m+p-1); interleaved (p-1)/(v*m+p-1)."""
    if not m or p < 2:
        return {"1f1b": None, "interleaved": None}
    return {
        "1f1b": (p - 1) / (m + p - 1),
        "interleaved": (p - 1) / (v * m + p - 1) if v > 1 else None,
    }


def _microbatch_count(first: RankResult) -> tuple[int | None, int]:
    counts, vs = [], 1
    for s in first.steps:
        fwd = {(m[1], m[2]) for m in s.microbatches if m[0] == "fwd"}
        if fwd:
            mbs = {m[1] for m in s.microbatches if m[0] == "fwd"}
            counts.append(len(mbs))
            vs = max(vs, 1 + max(m[2] for m in s.microbatches))
    if counts:
        return int(median(counts)), vs
    sends = defaultdict(int)
    for op in first.comm_ops:
        if op.step >= 0 and any(d == "send" for d, _ in op.p2p):
            sends[op.step] += 1
    if sends:
        return int(median(list(sends.values()))), 1
    return None, 1


def _union_length(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    total, cur_s, cur_e = 0, None, None
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


@dataclass(frozen=True, slots=True)
class _Step:
    """One rank's step on the common clock (its clock offset subtracted)."""

    start: int
    end: int
    computation: int
    microbatches: list[tuple[int, int]]
    #: first computation start and last computation end in the step (None: none)
    span: tuple[int, int] | None


def _on_common_clock(r: RankResult, offset: float) -> dict[int, _Step]:
    o = round(offset)
    return {
        s.step: _Step(
            s.start - o,
            s.end - o,
            s.computation,
            [(a - o, b - o) for *_, a, b in s.microbatches],
            None if s.compute_span is None else (s.compute_span[0] - o, s.compute_span[1] - o),
        )
        for s in r.steps
    }


def _first_work(sts: list[_Step]) -> int:
    """Where the members' step starts: its first computation (the ranks' own step ranges
    may open with a receive posted long before its data comes); without any, its start."""
    spans = [st.span[0] for st in sts if st.span]
    return min(spans) if spans else min(st.start for st in sts)


def _group_windows(members: list[dict[int, _Step]], steps: set[int]) -> dict[int, tuple[int, int]]:
    """Per step the group's window on the common clock: from the step's first computation
    on any member to the next step's first computation on any member (the step's tail, its
    all-reduce and optimizer, is the step's); the last step to its last member's end.

    Each rank's own step range ends where its next step begins, and those ranges overlap
    across a pipeline: in 1F1B a stage that is done with a step posts the next step's
    receives while the stages before it still run their backwards. A window spanning the
    members' own ranges would take in the next step's work; these windows never overlap."""
    numbers = sorted({n for m in members for n in m})
    first = [_first_work([m[n] for m in members if n in m]) for n in numbers]
    # the earliest first computation of any later step (suffix minima)
    later: dict[int, int | None] = {}
    low: int | None = None
    for n, t in zip(reversed(numbers), reversed(first), strict=True):
        later[n] = low
        low = t if low is None else min(low, t)
    out = {}
    for n in sorted(steps):
        sts = [m[n] for m in members]
        lo = _first_work(sts)
        hi = later[n]
        if hi is None:  # the last step: to the end of the group's last event
            hi = max(max(st.end, st.span[1] if st.span else st.end) for st in sts)
        elif hi <= lo:  # a later step computes before this one: the members' own ranges
            hi = max(st.end for st in sts)
        out[n] = (lo, max(hi, lo + 1))
    return out


def _busy_in(steps: dict[int, _Step], coarse: Intervals, offset: float, lo: int, hi: int) -> int:
    """A rank's computation in [lo, hi): its steps' computation when each step's lies
    wholly inside or outside; when one straddles an end (its work ran past the next step's
    first computation elsewhere), measured on the rank's coarse compute intervals (gaps
    under 20 us count as computation)."""
    busy = 0
    for st in steps.values():
        if st.span is None or st.span[1] <= lo or st.span[0] >= hi:
            continue
        if st.span[0] < lo or st.span[1] > hi:
            o = round(offset)
            return iv.total(iv.clip(coarse, lo + o, hi + o))
        busy += st.computation
    return busy


def _microbatch_extents(steps: dict[int, _Step]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Per step with microbatch ranges: their first start, last end, and the ranges."""
    return [
        (min(a for a, _ in st.microbatches), max(b for _, b in st.microbatches), st.microbatches)
        for st in steps.values()
        if st.microbatches
    ]


def _microbatches_in(
    extents: list[tuple[int, int, list[tuple[int, int]]]], lo: int, hi: int
) -> list[tuple[int, int]]:
    """A rank's microbatch ranges, of any step, that reach into [lo, hi)."""
    return [
        ab for a, b, mbs in extents if b > lo and a < hi for ab in mbs if ab[1] > lo and ab[0] < hi
    ]


def _schedule_windows(
    members: list[dict[int, _Step]], steps: set[int]
) -> dict[int, tuple[int, int]]:
    """Per step: the span of all members' microbatch ranges, where every member has some."""
    out = {}
    for n in steps:
        spans = [ab for m in members for ab in m[n].microbatches]
        if all(m[n].microbatches for m in members):
            out[n] = (min(a for a, _ in spans), max(b for _, b in spans))
    return out


def pipeline_report(
    results: list[RankResult], groups: list[list[int]], offsets: dict[int, float] | None = None
) -> dict[str, Any]:
    """Bubbles per stage. Windows span several ranks, so each rank's times are first put on
    a common clock with ``offsets`` (:func:`titan_core.trace.clock.clock_offsets`; the
    step windows reported are on that clock)."""
    offsets = offsets or {}
    by_rank = {r.rank: r for r in results}
    out_groups = []
    for g in groups:
        ranks = [by_rank[r] for r in g if r in by_rank]
        if len(ranks) < 2:
            continue
        m, v = _microbatch_count(ranks[0])
        members = [_on_common_clock(r, offsets.get(r.rank, 0.0)) for r in ranks]
        steps_common = set.intersection(*[set(x) for x in members])
        windows = _group_windows(members, steps_common)
        # With Titan's microbatch ranges, the bubble is measured over the schedule itself
        # (first microbatch start to last microbatch end across the group), as the
        # schedule's theoretical ratio counts it; the whole-step figure stays beside it.
        sched = _schedule_windows(members, steps_common)
        stages = []
        for si, (r, steps) in enumerate(zip(ranks, members, strict=True)):
            ratios, step_ratios, bubble, by_step = [], [], 0, []
            off = offsets.get(r.rank, 0.0)
            extents = _microbatch_extents(steps)
            for n in sorted(steps_common):
                lo, hi = windows[n]
                busy = _busy_in(steps, r.compute_coarse, off, lo, hi)
                step_idle = max(0, (hi - lo) - busy)
                step_ratios.append(step_idle / max(1, hi - lo))
                if n in sched:
                    # the rank's microbatches of any step inside the window count as busy
                    slo, shi = sched[n]
                    idle = (shi - slo) - _union_length(
                        _microbatches_in(extents, slo, shi), slo, shi
                    )
                    ratios.append(idle / max(1, shi - slo))
                else:
                    idle = step_idle
                    ratios.append(step_ratios[-1])
                bubble += idle
                by_step.append(
                    {
                        "step": n,
                        "bubble_ratio": round(ratios[-1], 4),
                        "step_bubble_ratio": round(step_ratios[-1], 4),
                        "bubble_us": int(idle),
                    }
                )
            stages.append(
                {
                    "stage": si,
                    "rank": r.rank,
                    "bubble_ratio": round(mean(ratios), 4) if ratios else None,
                    "step_bubble_ratio": round(mean(step_ratios), 4) if step_ratios else None,
                    "bubble_us": int(bubble / max(1, len(ratios))),
                    "compute_us": int(mean([steps[n].computation for n in steps_common] or [0])),
                    "by_step": by_step,
                }
            )
        theory = theoretical_bubble(len(g), m, v)
        out_groups.append(
            {
                "ranks": g,
                "stages": stages,
                "num_microbatches": m,
                "virtual_stages": v,
                "theoretical_bubble_ratio": theory,
                "steps": sorted(steps_common),
                "step_windows": {str(k): list(w) for k, w in sorted(windows.items())},
            }
        )
    return {"groups": out_groups}
