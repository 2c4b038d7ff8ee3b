"""Match comm ops across ranks: the k-th op of a process group in a step is the same
collective on every member; the k-th send r->q pairs with the k-th recv at q from r.

A collective whose trace names neither its group's ranks nor its name (older gloo host
ranges) is keyed by collective and size only, which would join the data-parallel
all-reduces of different pipeline stages into one; with the pipeline groups known such a
collective is matched only within its stage (ranks of one stage are a subset of any
group it can belong to, and the members of a subset still end it together)."""

from __future__ import annotations

from collections import defaultdict

from titan_core.trace.breakdown import RankResult

Key = tuple


def op_keys(
    results: list[RankResult], groups: list[list[int]] | None = None
) -> dict[tuple[int, int], list[Key]]:
    """(rank, op index) -> the cross-rank keys of that op; ``groups``: the pipeline groups
    (stage order), to match group-less collectives per stage."""
    stage_of = {r: s for g in groups or [] if len(g) > 1 for s, r in enumerate(g)}
    out: dict[tuple[int, int], list[Key]] = {}
    for r in results:
        stage = stage_of.get(r.rank)
        count: dict[Key, int] = defaultdict(int)
        for i, op in enumerate(r.comm_ops):
            if op.step < 0:
                continue
            keys: list[Key] = []
            if op.p2p:
                for direction, peer in op.p2p:
                    if peer is None:
                        continue
                    pair = (r.rank, peer) if direction == "send" else (peer, r.rank)
                    base = ("p", op.step, *pair)
                    keys.append((*base, count[base]))
                    count[base] += 1
            elif op.collective not in ("send", "recv", "sendrecv"):
                base = ("c", op.step, op.pg, op.collective)
                if stage is not None and op.pg_ranks is None and not op.pg.startswith("pg"):
                    base = (*base, stage)
                keys.append((*base, count[base]))
                count[base] += 1
            out[(r.rank, i)] = keys
    return out


def participants(keys: dict[tuple[int, int], list[Key]]) -> dict[Key, list[tuple[int, int]]]:
    part: dict[Key, list[tuple[int, int]]] = defaultdict(list)
    for ri, ks in keys.items():
        for k in ks:
            part[k].append(ri)
    return part
