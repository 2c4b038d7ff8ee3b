"""Match comm ops across ranks: the k-th op of a process group in a step is the same
collective on every member; the k-th send r->q pairs with the k-th recv at q from r."""

from __future__ import annotations

from collections import defaultdict

from titan_core.trace.breakdown import RankResult

Key = tuple


def op_keys(results: list[RankResult]) -> dict[tuple[int, int], list[Key]]:
    """(rank, op index) -> the cross-rank keys of that op."""
    out: dict[tuple[int, int], list[Key]] = {}
    for r in results:
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
