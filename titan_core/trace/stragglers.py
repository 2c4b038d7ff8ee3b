"""Slow ranks: late arrival at collectives (after clock-offset correction, see
:mod:`titan_core.trace.clock`) and compute outliers per step."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from titan_core.trace.breakdown import RankResult
from titan_core.trace.intervals import median
from titan_core.trace.matching import Key


def late_arrivals(
    results: list[RankResult], parts: dict[Key, list[tuple[int, int]]], offsets: dict[int, float]
) -> dict[int, dict[str, float]]:
    """Per rank: how often it arrived last at a collective and the wait it caused
    (its corrected arrival minus the median arrival of the members)."""
    by_rank = {r.rank: r for r in results}
    stats: dict[int, dict[str, float]] = defaultdict(lambda: {"last": 0, "delay_us": 0.0, "n": 0})
    for key, members in parts.items():
        if key[0] != "c" or len(members) < 2:
            continue
        arr = [by_rank[r].comm_ops[i].ts - offsets[r] for r, i in members]
        j = arr.index(max(arr))
        for r, _ in members:
            stats[r]["n"] += 1
        r_last = members[j][0]
        stats[r_last]["last"] += 1
        stats[r_last]["delay_us"] += float(arr[j] - median(arr))
    return stats


def compute_outliers(
    results: list[RankResult], peer_class: dict[int, Any]
) -> dict[int, dict[str, float]]:
    """Steps where a rank's compute time is far above its peers' (same pipeline stage):
    other ranks only (a step number a rank's trace holds twice is summed, not compared)."""
    table: dict[tuple[Any, int], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in results:
        for s in r.steps:
            table[(peer_class.get(r.rank, 0), s.step)][r.rank] += s.computation
    out: dict[int, dict[str, float]] = defaultdict(lambda: {"steps": 0, "excess_us": 0.0})
    for by_rank in table.values():
        vals = list(by_rank.items())
        if len(vals) < 2:
            continue
        x = [float(v) for _, v in vals]
        for j, (rank, _) in enumerate(vals):
            others = x[:j] + x[j + 1 :]
            med = median(others)
            mad = median([abs(o - med) for o in others]) * 1.4826
            xv = x[j]
            if xv > med * 1.05 and (mad == 0 or (xv - med) / mad > 3.0):
                out[rank]["steps"] += 1
                out[rank]["excess_us"] += xv - med
                out[rank]["median_us"] = med
    return out


def slow_ranks(
    results: list[RankResult],
    parts: dict[Key, list[tuple[int, int]]],
    offsets: dict[int, float],
    peer_class: dict[int, Any],
) -> list[dict[str, Any]]:
    """Ranks ordered by severity (the step time they cost, in us), with the evidence."""
    late = late_arrivals(results, parts, offsets)
    comp = compute_outliers(results, peer_class)
    med_step = median([s.end - s.start for r in results for s in r.steps] or [0])
    out = []
    members = max(2.0, median([len(m) for m in parts.values()] or [2]))
    for r in results:
        lt, co = late.get(r.rank), comp.get(r.rank)
        n = lt["n"] if lt else 0
        # arriving last more often than chance, with a visible delay
        late_flag = (
            lt is not None
            and n > 0
            and lt["last"] / n > 1.0 / members + 0.25
            and lt["delay_us"] > 0
        )
        comp_flag = co is not None and co["steps"] > 0
        if not (late_flag or comp_flag):
            continue
        severity = (lt["delay_us"] if late_flag else 0.0) + (co["excess_us"] if comp_flag else 0.0)
        if severity < 0.005 * med_step:
            continue
        evidence: dict[str, Any] = {"clock_offset_us": round(offsets.get(r.rank, 0.0), 1)}
        if late_flag:
            evidence["last_arrivals"] = int(lt["last"])
            evidence["collectives"] = int(n)
            evidence["late_delay_us"] = round(lt["delay_us"], 1)
        if comp_flag:
            evidence["compute_outlier_steps"] = int(co["steps"])
            evidence["compute_excess_us"] = round(co["excess_us"], 1)
            evidence["peer_median_compute_us"] = round(co.get("median_us", 0.0), 1)
        out.append({"rank": r.rank, "severity_us": round(severity, 1), "evidence": evidence})
    out.sort(key=lambda e: -e["severity_us"])
    return out
