"""The per-rank interval arithmetic against brute force, microsecond by microsecond, on
random device events: interval unions, HTA's kernel breakdown (device events launched
before the last profiler step), step windows, and each step's time breakdown, overlap and
idle split."""

import random

import pytest

from titan_core.trace import intervals as iv
from titan_core.trace.breakdown import analyze_rank
from titan_core.trace.categories import TraceConfig
from titan_core.trace.parse import Events, RankTrace

#: a kernel name of each kind, as TraceConfig classifies them
NAMES = {
    "computation": "ampere_sgemm_128x64_nn",
    "communication": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    "memory": "Memcpy HtoD (Pageable -> Device)",
    "other": "SyncKernel",
}
KINDS = ("computation", "communication", "memory")


def _points(starts: list[int], ends: list[int]) -> set[int]:
    return {t for s, e in zip(starts, ends, strict=True) for t in range(s, e)}


@pytest.mark.parametrize("seed", range(30))
def test_merge_and_prefix_union(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(0, 60)
    pairs = sorted((s, s + rng.randint(0, 12)) for s in (rng.randint(0, 300) for _ in range(n)))
    starts, ends = [p[0] for p in pairs], [p[1] for p in pairs]
    k = rng.randint(0, n)
    merged, head = iv.merge_with_prefix(starts, ends, k)
    assert merged == iv.merge(starts, ends)
    assert merged == iv.merge(starts[::-1], ends[::-1])  # unsorted input is sorted first
    assert _points(*merged) == _points(starts, ends)
    assert head == len(_points(starts[:k], ends[:k]))
    # sorted, disjoint and not touching, no empty intervals
    ms, me = merged
    assert all(s < e for s, e in zip(ms, me, strict=True))
    assert all(e < s for e, s in zip(me, ms[1:], strict=False))


def _random_rank(rng: random.Random) -> tuple[RankTrace, list[dict], list[tuple[int, int]]]:
    ev = Events(has_stream=True)
    events = []
    for corr in range(rng.randint(1, 80)):
        ts = rng.randint(0, 900)
        kind = rng.choice(["computation"] * 4 + ["communication"] * 2 + ["memory", "other"])
        launch = None if rng.random() < 0.1 else ts - rng.randint(0, 60)
        events.append({"ts": ts, "end": ts + rng.randint(0, 40), "kind": kind, "launch": launch})
        ev.dev_ts.append(ts)
        ev.dev_end.append(events[-1]["end"])
        ev.dev_name.append(NAMES[kind])
        ev.dev_corr.append(corr)
        ev.dev_info.append(None)
        if launch is not None:
            ev.launch_corr.append(corr)
            ev.launch_ts.append(launch)
            ev.launch_tid.append(1)
    bounds = sorted(rng.sample(range(-60, 900), rng.randint(1, 4)))
    steps = [(s, e) for s, e in zip(bounds, [*bounds[1:], 1000], strict=True)]
    for i, (s, e) in enumerate(steps):
        ev.host_ts.append(s)
        ev.host_end.append(e)
        ev.host_name.append(f"ProfilerStep#{i + 1}")
        ev.host_cat.append("user_annotation")
        ev.host_tid.append(1)
        ev.host_info.append(None)
    return RankTrace("rank0.json", 0, {"device": "gpu"}, ev), events, steps


def _union_points(events: list[dict], kinds: tuple[str, ...]) -> set[int]:
    return {t for e in events if e["kind"] in kinds for t in range(e["ts"], e["end"])}


@pytest.mark.parametrize("seed", range(200))
def test_rank_breakdown_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    rt, events, steps = _random_rank(rng)
    cfg = TraceConfig()
    r = analyze_rank(rt, cfg, 0)

    # kernel breakdown: with two or more steps, only events launched before the last one
    counted = events
    if len(steps) >= 2:
        last = max(s for s, _ in steps)
        counted = [e for e in events if e["launch"] is not None and e["launch"] < last]
    for kind in KINDS:
        assert r.kernel_time_us[kind] == len(_union_points(counted, (kind,))), kind
        assert r.kernel_counts[kind] == sum(e["kind"] == kind for e in counted), kind

    # step windows: from the first event launched in the step (its start without a
    # launch) to the first of the next step with any; the last to its last end
    by_start = sorted(events, key=lambda e: e["ts"])  # stable: ties keep file order
    firsts = []
    for s, e in steps:
        mine = [x for x in events if s <= (x["ts"] if x["launch"] is None else x["launch"]) < e]
        firsts.append((min(x["ts"] for x in mine), max(x["end"] for x in mine)) if mine else None)
    windows = []
    for i, f in enumerate(firsts):
        if f is not None:
            nxt = next((x for x in firsts[i + 1 :] if x is not None), None)
            windows.append((f[0], max(nxt[0] if nxt else f[1], f[0] + 1)))
    comp = _union_points(events, ("computation",))
    comm = _union_points(events, ("communication",))
    mem = _union_points(events, ("memory",))
    busy = comp | comm | mem
    if not windows and busy:  # no event in any step: the whole trace is one
        windows = [(min(busy), max(busy) + 1)]
    assert [(st.start, st.end) for st in r.steps] == windows
    thr = cfg.kernel_wait_threshold_us
    for st in r.steps:
        span = range(st.start, st.end)
        assert st.computation == sum(t in comp for t in span)
        assert st.comm_total == sum(t in comm for t in span)
        assert st.overlap == sum(t in comp and t in comm for t in span)
        assert st.communication == sum(t in comm and t not in comp for t in span)
        assert st.memory == sum(t in mem and t not in comp and t not in comm for t in span)
        idle = [t for t in span if t not in busy]
        assert st.idle == len(idle)
        # idle runs, each split by what the next device event to start waited for
        want = {"host": 0, "kernel": 0, "other": 0}
        runs: list[list[int]] = []
        for t in idle:
            if runs and runs[-1][1] == t:
                runs[-1][1] = t + 1
            else:
                runs.append([t, t + 1])
        for a, b in runs:
            nxt = next((e for e in by_start if e["ts"] >= b), None)
            if nxt is None:
                want["other"] += b - a
            elif nxt["launch"] is not None and nxt["launch"] > a:
                want["host"] += b - a
            elif b - a <= thr:
                want["kernel"] += b - a
            else:
                want["other"] += b - a
        assert (st.host_wait, st.kernel_wait, st.other_wait) == (
            want["host"],
            want["kernel"],
            want["other"],
        )


@pytest.mark.parametrize("seed", range(30))
def test_gaps_complement_the_union(seed: int) -> None:
    rng = random.Random(seed)
    starts = [rng.randint(0, 200) for _ in range(rng.randint(0, 30))]
    merged = iv.merge(starts, [s + rng.randint(0, 15) for s in starts])
    lo, hi = sorted(rng.sample(range(-20, 240), 2))
    gs, ge = iv.gaps(merged, lo, hi)
    assert _points(gs, ge) == set(range(lo, hi)) - _points(*merged)
    assert all(s < e for s, e in zip(gs, ge, strict=True))
    assert all(e < s for e, s in zip(ge, gs[1:], strict=False))
