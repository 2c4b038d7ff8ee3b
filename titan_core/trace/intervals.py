"""Interval arithmetic on numpy arrays: unions and per-combination coverage.

All analyses reduce to "how long was at least one event of set A running, and did it
overlap set B". Events are half-open [start, end) intervals in integer microseconds.
"""

from __future__ import annotations

import numpy as np

Intervals = tuple[np.ndarray, np.ndarray]


def merge(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """Union of intervals as sorted, disjoint (start, end) arrays."""
    if len(starts) == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e.copy()
    order = np.argsort(starts, kind="stable")
    s = np.asarray(starts, dtype=np.int64)[order]
    e = np.asarray(ends, dtype=np.int64)[order]
    run_end = np.maximum.accumulate(e)
    # a new group starts where an interval begins after everything before it has ended
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    out_s = s[idx]
    last = np.append(idx[1:], len(s)) - 1
    out_e = run_end[last]
    keep = out_e > out_s
    return out_s[keep], out_e[keep]


def total(iv: Intervals) -> int:
    return int((iv[1] - iv[0]).sum())


def clip(iv: Intervals, lo: int, hi: int) -> Intervals:
    """Restrict merged intervals to [lo, hi)."""
    s, e = iv
    i0 = np.searchsorted(e, lo, side="right")
    i1 = np.searchsorted(s, hi, side="left")
    s = np.maximum(s[i0:i1], lo)
    e = np.minimum(e[i0:i1], hi)
    keep = e > s
    return s[keep], e[keep]


def coverage(sets: list[Intervals]) -> np.ndarray:
    """Time spent in each combination of the given merged interval sets.

    Returns an array of length 2**len(sets); entry ``m`` is the time during which exactly
    the sets whose bits are set in ``m`` are active (entry 0, the time covered by none, is
    left at 0 since it has no bounded extent).
    """
    k = len(sets)
    times = []
    deltas = []
    for i, (s, e) in enumerate(sets):
        times += [s, e]
        bit = 1 << i
        deltas += [np.full(len(s), bit, dtype=np.int64), np.full(len(e), -bit, dtype=np.int64)]
    out = np.zeros(1 << k, dtype=np.int64)
    if not times:
        return out
    t = np.concatenate(times)
    d = np.concatenate(deltas)
    if len(t) == 0:
        return out
    order = np.argsort(t, kind="stable")
    t = t[order]
    state = np.cumsum(d[order])
    span = np.diff(t)
    np.add.at(out, state[:-1], span)
    out[0] = 0
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """Merged intervals of ``a`` minus ``b`` (both merged)."""
    if len(b[0]) == 0 or len(a[0]) == 0:
        return a
    t = np.concatenate([a[0], a[1], b[0], b[1]])
    d = np.concatenate(
        [
            np.full(len(a[0]), 1),
            np.full(len(a[1]), -1),
            np.full(len(b[0]), 2),
            np.full(len(b[1]), -2),
        ]
    )
    order = np.argsort(t, kind="stable")
    t = t[order]
    state = np.cumsum(d[order])
    on = state == 1
    starts = t[:-1][on[:-1]]
    ends = t[1:][on[:-1]]
    keep = ends > starts
    return merge(starts[keep], ends[keep])


def gaps(iv: Intervals, lo: int, hi: int) -> Intervals:
    """The complement of merged intervals within [lo, hi)."""
    s, e = clip(iv, lo, hi)
    gs = np.concatenate([[lo], e])
    ge = np.concatenate([s, [hi]])
    keep = ge > gs
    return gs[keep].astype(np.int64), ge[keep].astype(np.int64)
