"""Cross-rank critical path of a step, and what-if replays.

Model: each rank is a sequence of comm ops (collectives, P2P) separated by local work.
An op is *issued* after the local work since the previous op (or since that op was issued,
when the trace shows the two overlapping), and *completes* when every member has issued
its side, plus the transfer time (the shortest duration seen among the members: the last
to arrive barely waits). Replaying the trace with the observed durations reproduces it;
replaying with one rank's local work scaled to the median speed answers "what if this rank
were not slow". The critical path walks back from the last rank to finish: through local
work on a rank, and across ranks to whoever arrived last at each op.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from titan_core.trace import intervals as iv
from titan_core.trace.breakdown import RankResult
from titan_core.trace.intervals import Intervals, median
from titan_core.trace.matching import Key


@dataclass(slots=True)
class _Op:
    rank: int
    idx: int
    s: float  # corrected observed start
    e: float
    keys: list[Key]
    blocking: bool  # issued only after the previous op completed
    work: float  # local work before issuing (from prev completion or prev issue)


def _build(
    results: list[RankResult],
    step: int,
    keys: dict[tuple[int, int], list[Key]],
    offsets: dict[int, float],
) -> tuple[dict[int, list[_Op]], dict[int, tuple[float, float]]]:
    seqs: dict[int, list[_Op]] = {}
    bounds: dict[int, tuple[float, float]] = {}
    for r in results:
        st = next((s for s in r.steps if s.step == step), None)
        if st is None:
            continue
        off = offsets.get(r.rank, 0.0)
        lo, hi = st.start - off, st.end - off
        ops = []
        prev_s, prev_e = lo, lo
        for i, op in enumerate(r.comm_ops):
            if op.step != step:
                continue
            s, e = op.ts - off, op.end - off
            blocking = s >= prev_e
            work = (s - prev_e) if blocking else (s - prev_s)
            ops.append(_Op(r.rank, i, s, e, keys.get((r.rank, i), []), blocking, max(0.0, work)))
            prev_s, prev_e = s, max(e, prev_e)
        seqs[r.rank] = ops
        bounds[r.rank] = (lo, hi)
    return seqs, bounds


def replay(
    seqs: dict[int, list[_Op]],
    bounds: dict[int, tuple[float, float]],
    scale: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Replay one step; returns step time, per-rank ends and the dependency pointers
    (``arrive``, ``done``, ``cause``: per rank, a list over its ops)."""
    scale = scale or {}
    members: dict[Key, list[tuple[int, int]]] = defaultdict(list)
    for r, ops in seqs.items():
        for j, op in enumerate(ops):
            for k in op.keys:
                members[k].append((r, j))
    kdur: dict[Key, float] = {
        k: min(seqs[r][j].e - seqs[r][j].s for r, j in m) for k, m in members.items()
    }
    arrive: dict[int, list[float]] = {r: [0.0] * len(ops) for r, ops in seqs.items()}
    done: dict[int, list[float]] = {r: [0.0] * len(ops) for r, ops in seqs.items()}
    cause: dict[int, list[tuple[int, int]]] = {r: [(r, 0)] * len(ops) for r, ops in seqs.items()}
    ptr = {r: 0 for r in seqs}  # ops completed
    arrived = {r: 0 for r in seqs}  # ops issued (ptr or one more, when blocked)
    pending = set(r for r in seqs if seqs[r])
    # event-driven: a rank blocked on a key waits until all of its members have arrived
    missing = {k: len(m) for k, m in members.items()}
    waiters: dict[Key, list[int]] = defaultdict(list)
    work = [r for r in seqs if seqs[r]]
    while pending:
        while work:
            r = work.pop()
            if r not in pending:
                continue
            ops, sc = seqs[r], scale.get(r, 1.0)
            r_arrive, r_done, r_cause = arrive[r], done[r], cause[r]
            j = ptr[r]
            while j < len(ops):
                op = ops[j]
                if arrived[r] == j:
                    if j == 0:
                        base = bounds[r][0]
                    elif op.blocking:
                        base = r_done[j - 1]
                    else:
                        base = r_arrive[j - 1]
                    r_arrive[j] = base + op.work * sc
                    arrived[r] = j + 1
                    for k in op.keys:
                        missing[k] -= 1
                        if missing[k] == 0:
                            work.extend(waiters.pop(k, ()))
                blocker = None
                for k in op.keys:
                    if missing[k] > 0:
                        blocker = k
                        break
                if blocker is not None:
                    waiters[blocker].append(r)
                    break
                ready, who = r_arrive[j], (r, j)
                d = None  # the transfer: the longest of its keys' shortest durations
                for k in op.keys:
                    for m in members[k]:
                        t = arrive[m[0]][m[1]]
                        if t > ready:
                            ready, who = t, m
                    if d is None or kdur[k] > d:
                        d = kdur[k]
                if d is None:
                    d = op.e - op.s
                r_done[j] = ready + d
                r_cause[j] = who
                j += 1
            ptr[r] = j
            if j >= len(ops):
                pending.discard(r)
        if pending:
            # inconsistent matching (ops missing on some member): release the earliest one
            r = min(
                pending,
                key=lambda x: arrive[x][ptr[x]] if arrived[x] > ptr[x] else float("inf"),
            )
            op = seqs[r][ptr[r]]
            op.keys = []
            work.append(r)
    ends = {}
    for r, ops in seqs.items():
        lo, hi = bounds[r]
        if ops:
            last = ops[-1]
            tail = max(0.0, hi - max(last.e, lo))
            ends[r] = done[r][-1] + tail * scale.get(r, 1.0)
        else:
            ends[r] = lo + (hi - lo) * scale.get(r, 1.0)
    start = min(b[0] for b in bounds.values())
    return {"start": start, "ends": ends, "arrive": arrive, "done": done, "cause": cause}


def critical_path(
    seqs: dict[int, list[_Op]],
    bounds: dict[int, tuple[float, float]],
    rep: dict[str, Any],
    compute: dict[int, tuple[Intervals, float]] | None = None,
) -> dict[str, Any]:
    """Walk back from the last rank to finish; segments are local work or transfers.

    ``compute``: per rank, its compute stream's busy intervals (on its own clock) and its
    clock offset: a local segment's time is then split into ``compute`` (the stream busy)
    and ``idle`` (host overhead, launch waits, copies: local time without computation);
    without it, all local time counts as ``compute``."""
    ends = rep["ends"]
    r = max(ends, key=lambda x: ends[x])
    segs: list[tuple[int, str, float, float]] = []
    n = len(seqs[r])
    if n == 0:
        segs.append((r, "compute", bounds[r][0], ends[r]))
        state = None
    else:
        segs.append((r, "compute", rep["done"][r][n - 1], ends[r]))
        state = ("done", r, n - 1)
    guard = 0
    while state is not None and guard < 1_000_000:
        guard += 1
        what, r, j = state
        if what == "done":
            cr, cj = rep["cause"][r][j]
            segs.append((r, "comm", rep["arrive"][cr][cj], rep["done"][r][j]))
            state = ("arrive", cr, cj)
            continue
        op = seqs[r][j]
        t = rep["arrive"][r][j]
        if j == 0:
            segs.append((r, "compute", bounds[r][0], t))
            state = None
        elif op.blocking:
            segs.append((r, "compute", rep["done"][r][j - 1], t))
            state = ("done", r, j - 1)
        else:
            segs.append((r, "compute", rep["arrive"][r][j - 1], t))
            state = ("arrive", r, j - 1)
    segs = [s for s in reversed(segs) if s[3] > s[2]]
    merged: list[list[Any]] = []
    for s in segs:
        if merged and merged[-1][0] == s[0] and merged[-1][1] == s[1]:
            merged[-1][3] = s[3]
        else:
            merged.append(list(s))
    by_kind: dict[str, float] = defaultdict(float)
    by_rank: dict[int, float] = defaultdict(float)
    segments = []
    for rank, kind, a, b in merged:
        seg = {"rank": rank, "kind": kind, "start_us": round(a, 1), "end_us": round(b, 1)}
        if kind == "comm":
            by_kind["comm"] += b - a
        else:
            busy = b - a
            if compute is not None and rank in compute:
                intervals, off = compute[rank]
                busy = float(iv.total(iv.clip(intervals, a + off, b + off)))
                by_kind["idle"] += (b - a) - busy
                seg["compute_us"] = round(busy, 1)
            by_kind["compute"] += busy
            by_rank[rank] += busy
        segments.append(seg)
    return {
        "length_us": round(max(ends.values()) - rep["start"], 1),
        "time_by_kind_us": {k: round(v, 1) for k, v in by_kind.items()},
        "compute_by_rank_us": {
            str(k): round(v, 1) for k, v in sorted(by_rank.items(), key=lambda x: -x[1])[:20]
        },
        "segments": segments[:400],
    }


def analyze_steps(
    results: list[RankResult],
    keys: dict[tuple[int, int], list[Key]],
    offsets: dict[int, float],
    peer_class: dict[int, Any],
    candidates: list[int],
    max_steps: int = 3,
) -> dict[str, Any]:
    """Critical path and what-if (candidate ranks at their peers' median speed) per step."""
    steps = sorted({s.step for r in results for s in r.steps})
    if not steps:
        return {"steps": []}
    # a rank's speed: its compute time per step against its peers' median
    comp: dict[tuple[Any, int], list[tuple[int, int]]] = defaultdict(list)
    for r in results:
        for s in r.steps:
            comp[(peer_class.get(r.rank, 0), s.step)].append((r.rank, s.computation))
    compute = {r.rank: (r.compute_coarse, offsets.get(r.rank, 0.0)) for r in results}
    out = []
    for step in steps[-max_steps:]:
        seqs, bounds = _build(results, step, keys, offsets)
        if not seqs:
            continue
        rep = replay(seqs, bounds)
        base = max(rep["ends"].values()) - rep["start"]
        observed = max(b[1] for b in bounds.values()) - min(b[0] for b in bounds.values())
        entry: dict[str, Any] = {
            "step": step,
            "observed_us": round(observed, 1),
            "replayed_us": round(base, 1),
            "critical_path": critical_path(seqs, bounds, rep, compute),
            "what_if": [],
        }
        for cand in candidates:
            vals = comp.get((peer_class.get(cand, 0), step), [])
            own = next((v for r, v in vals if r == cand), None)
            if not own or len(vals) < 2:
                continue
            med = median([v for _, v in vals])
            if med >= own:
                continue
            rep2 = replay(seqs, bounds, {cand: med / own})
            t2 = max(rep2["ends"].values()) - rep2["start"]
            entry["what_if"].append(
                {
                    "rank": cand,
                    "speedup_of_rank": round(own / med, 3),
                    "step_us": round(t2, 1),
                    "saved_us": round(base - t2, 1),
                }
            )
        out.append(entry)
    return {"steps": out}
