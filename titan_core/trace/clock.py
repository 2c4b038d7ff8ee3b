"""Per-rank clock offsets, so that events of different ranks can be compared.

Two kinds of evidence, in this order:

- Collectives: the members of a collective finish it at (nearly) the same true time, so
  within a set of ranks linked by collectives each rank's offset is the median of how much
  later its end timestamps are than the median end of the members. This fixes the offsets
  inside such a set up to one constant per set.
- P2P transfers link the sets (a PP x DP job has one per pipeline stage, connected only by
  sends and receives). Causality is what is physically guaranteed: a receive cannot end
  before its send started (NCCL and gloo alike, coalesced kernels included). A transfer
  from set A to set B bounds ``shift_B - shift_A`` from above by the receive's end minus
  the send's start; transfers the other way bound it from below. With both directions
  (forward activations, backward gradients) the shift is the middle of the two bounds,
  as NTP does, which cancels the transfer time when the directions take as long. Each
  bound is a low quantile over many transfers, not one pair: a receive posted late, or a
  sender blocked on its receiver, only loosens a bound, and with 20 transfers or more a
  mismatched pair cannot pull it below the truth on its own. With one direction only,
  the fastest receive is taken to end when its send ended. Clock drift during the trace
  is not modelled (one offset per rank).

The set shifts are solved by weighted least squares over the graph of sets (a spanning
tree first, then Gauss-Seidel sweeps for any cycles), relative to the lowest rank.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence

from titan_core.trace.breakdown import RankResult
from titan_core.trace.intervals import median
from titan_core.trace.matching import Key

#: quantile of the per-transfer bounds taken as the bound (the minimum for fewer than
#: 1 / QUANTILE transfers)
QUANTILE = 0.05
_MAX_SWEEPS = 50
_TOL_US = 0.01


def clock_offsets(
    results: list[RankResult], parts: dict[Key, list[tuple[int, int]]]
) -> dict[int, float]:
    """Per rank, microseconds to subtract from its timestamps to put them on the clock of
    the lowest rank it is linked to (by collectives or P2P transfers)."""
    by_rank = {r.rank: r for r in results}
    offsets = _collective_offsets(by_rank, parts)
    comp = _components(sorted(by_rank), parts)
    shift, anchor = _solve(sorted(set(comp.values())), _p2p_links(by_rank, parts, offsets, comp))
    out = {r: offsets[r] + shift[comp[r]] for r in by_rank}
    # set ids are their lowest ranks, so each group's anchor set id is its lowest rank
    return {r: out[r] - out[anchor[comp[r]]] for r in out}


def _collective_offsets(
    by_rank: dict[int, RankResult], parts: dict[Key, list[tuple[int, int]]]
) -> dict[int, float]:
    """Offsets from collective end times, exact up to one constant per collective-linked
    set of ranks (alternating: centre of each collective, then each rank's median lag)."""
    offsets = {r: 0.0 for r in by_rank}
    colls = [m for k, m in parts.items() if k[0] == "c" and len(m) > 1]
    for _ in range(_MAX_SWEEPS):
        resid: dict[int, list[float]] = defaultdict(list)
        for members in colls:
            ends = [by_rank[r].comm_ops[i].end - offsets[r] for r, i in members]
            med = median(ends)
            for (r, _), e in zip(members, ends, strict=True):
                resid[r].append(e - med)
        step = {r: median(v) for r, v in resid.items()}
        for r, d in step.items():
            offsets[r] += d
        if not step or max(abs(d) for d in step.values()) < _TOL_US:
            break
    return offsets


def _components(ranks: list[int], parts: dict[Key, list[tuple[int, int]]]) -> dict[int, int]:
    """Rank -> the lowest rank of its collective-linked set (union-find)."""
    up = {r: r for r in ranks}

    def find(x: int) -> int:
        while up[x] != x:
            up[x] = up[up[x]]
            x = up[x]
        return x

    for k, members in parts.items():
        if k[0] != "c" or len(members) < 2:
            continue
        roots = sorted({find(r) for r, _ in members})
        for x in roots[1:]:
            up[x] = roots[0]
    return {r: find(r) for r in ranks}


#: (set A, set B) with A < B -> (estimate of shift_B - shift_A, weight)
Links = dict[tuple[int, int], tuple[float, float]]


def _p2p_links(
    by_rank: dict[int, RankResult],
    parts: dict[Key, list[tuple[int, int]]],
    offsets: dict[int, float],
    comp: dict[int, int],
) -> Links:
    # per ordered (sender's set, receiver's set): causal gaps recv.end - send.start, and
    # recv.end - send.end, both on the collective-corrected clocks
    gaps: dict[tuple[int, int], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for key, members in parts.items():
        if key[0] != "p" or len(members) != 2:
            continue
        src, dst = key[2], key[3]
        side = dict(members)
        if src == dst or src not in side or dst not in side or comp[src] == comp[dst]:
            continue
        send = by_rank[src].comm_ops[side[src]]
        recv = by_rank[dst].comm_ops[side[dst]]
        end = recv.end - offsets[dst]
        g = gaps[(comp[src], comp[dst])]
        g[0].append(end - (send.ts - offsets[src]))
        g[1].append(end - (send.end - offsets[src]))
    links: Links = {}
    for a, b in {(min(p), max(p)) for p in gaps}:
        fwd, bwd = gaps.get((a, b)), gaps.get((b, a))
        if fwd and bwd:
            # shift_b - shift_a <= q(fwd start gaps) and >= -q(bwd start gaps)
            est = (low_quantile(fwd[0]) - low_quantile(bwd[0])) / 2
            n = min(len(fwd[0]), len(bwd[0]))
        elif fwd:
            est, n = low_quantile(fwd[1]), len(fwd[1])
        elif bwd:
            est, n = -low_quantile(bwd[1]), len(bwd[1])
        else:
            continue
        links[(a, b)] = (est, float(n))
    return links


def low_quantile(values: Sequence[float], q: float = QUANTILE) -> float:
    """The ``floor(q * n)``-th smallest value: the minimum for small samples, robust to a
    few outliers below the bulk for large ones."""
    v = sorted(values)
    return v[int(q * len(v))]


def _solve(sets: list[int], links: Links) -> tuple[dict[int, float], dict[int, int]]:
    """Shifts minimizing the weighted squared misfit of the links, and each set's anchor
    (the lowest set of its linked group, at shift 0). A maximum spanning tree (Prim) gives
    the start, exact without cycles; Gauss-Seidel sweeps then spread a cycle's misfit."""
    adj: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    for (a, b), (d, w) in links.items():
        adj[a].append((b, d, w))  # shift_b - shift_a = d
        adj[b].append((a, -d, w))
    shift: dict[int, float] = {}
    anchor: dict[int, int] = {}
    for s in sets:  # ascending: the first set reached of each group is its lowest
        if s in shift:
            continue
        shift[s], anchor[s] = 0.0, s
        heap = [(-w, y, s, d) for y, d, w in adj[s]]
        heapq.heapify(heap)
        while heap:
            _, y, x, d = heapq.heappop(heap)
            if y in shift:
                continue
            shift[y], anchor[y] = shift[x] + d, s
            for z, dz, wz in adj[y]:
                if z not in shift:
                    heapq.heappush(heap, (-wz, z, y, dz))
    free = [x for x in sets if adj[x] and anchor[x] != x]
    for _ in range(_MAX_SWEEPS * 20):
        moved = 0.0
        for x in free:
            tw = sum(w for _, _, w in adj[x])
            new = sum(w * (shift[y] - d) for y, d, w in adj[x]) / tw
            moved = max(moved, abs(new - shift[x]))
            shift[x] = new
        if moved < _TOL_US:
            break
    return shift, anchor
