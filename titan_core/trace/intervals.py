"""Interval arithmetic on plain lists: unions and per-combination coverage.

All analyses reduce to "how long was at least one event of set A running, and did it
overlap set B". Events are half-open [start, end) intervals in integer microseconds.
Results are plain lists (the per-step code bisects them). The sweeps over many intervals
(:func:`merge`, :func:`coverage`) run in numpy; small inputs take a plain-Python sweep,
so analyzing a small trace never imports numpy (its import alone is ~11 MB of memory).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

Intervals = tuple[list[int], list[int]]

_FIRST = itemgetter(0)


#: from this many intervals on, sweeps run in numpy
NUMPY_MIN = 2048


def _np() -> Any:
    import numpy

    return numpy


def merge(starts: Sequence[int], ends: Sequence[int]) -> Intervals:
    """Union of intervals as sorted, disjoint (start, end) lists; touching ones join and
    empty ones vanish."""
    if len(starts) < NUMPY_MIN or not len(starts):
        return _merge_py(starts, ends)
    np = _np()
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    order = np.argsort(s, kind="stable")
    s, e = s[order], np.maximum.accumulate(e[order])
    # a new interval begins where a start lies past every end before it
    first = np.flatnonzero(s[1:] > e[:-1]) + 1
    out_s = s[np.concatenate(([0], first))]
    out_e = e[np.concatenate((first - 1, [s.size - 1]))]
    keep = out_e > out_s
    return out_s[keep].tolist(), out_e[keep].tolist()


def total(iv: Intervals) -> int:
    return sum(iv[1]) - sum(iv[0])


def clip(iv: Intervals, lo: int, hi: int) -> Intervals:
    """Restrict merged intervals to [lo, hi)."""
    s, e = iv
    i0 = bisect_right(e, lo)  # first interval ending after lo
    i1 = bisect_left(s, hi)  # past the last one starting before hi
    if i1 <= i0:
        return [], []
    out_s, out_e = s[i0:i1], e[i0:i1]
    # disjoint and sorted: only the first can start before lo, only the last end after hi
    if out_s[0] < lo:
        out_s[0] = lo
    if out_e[-1] > hi:
        out_e[-1] = hi
    return out_s, out_e


def coverage(sets: list[Intervals]) -> list[int]:
    """Time spent in each combination of the given merged interval sets.

    Returns a list of length 2**len(sets); entry ``m`` is the time during which exactly
    the sets whose bits are set in ``m`` are active (entry 0, the time covered by none, is
    left at 0 since it has no bounded extent).
    """
    n = 1 << len(sets)
    if sum(len(st[0]) for st in sets) < NUMPY_MIN // 2:
        return _coverage_py(sets)
    np = _np()
    times = [np.asarray(t, dtype=np.int64) for st in sets for t in st]
    if not sum(t.size for t in times):
        return [0] * n
    steps = [
        np.full(len(t), sign << i, dtype=np.int64)
        for i, st in enumerate(sets)
        for sign, t in ((1, st[0]), (-1, st[1]))
    ]
    t = np.concatenate(times)
    order = np.argsort(t, kind="stable")
    t = t[order]
    state = np.cumsum(np.concatenate(steps)[order])  # the sets active after each point
    out = np.bincount(state[:-1], weights=np.diff(t), minlength=n)
    res = [int(round(x)) for x in out[:n]]
    res[0] = 0
    return res


def _merge_py(starts: Sequence[int], ends: Sequence[int]) -> Intervals:
    out_s: list[int] = []
    out_e: list[int] = []
    if len(starts) == 0:
        return out_s, out_e
    pairs = sorted(zip(starts, ends, strict=True))  # equal starts: order is irrelevant
    cur_s, cur_e = pairs[0]
    for s, e in pairs:
        if s > cur_e:
            if cur_e > cur_s:
                out_s.append(cur_s)
                out_e.append(cur_e)
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e > cur_s:
        out_s.append(cur_s)
        out_e.append(cur_e)
    return out_s, out_e


def _coverage_py(sets: list[Intervals]) -> list[int]:
    out = [0] * (1 << len(sets))
    pts: list[tuple[int, int]] = []
    for i, (s, e) in enumerate(sets):
        bit = 1 << i
        pts += [(t, bit) for t in s]
        pts += [(t, -bit) for t in e]
    if not pts:
        return out
    pts.sort(key=_FIRST)
    state = 0
    prev = pts[0][0]
    for t, d in pts:
        if t != prev:
            out[state] += t - prev
            prev = t
        state += d
    out[0] = 0
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """Merged intervals of ``a`` minus ``b`` (both merged)."""
    if len(b[0]) == 0 or len(a[0]) == 0:
        return a
    pts = [(t, 1) for t in a[0]] + [(t, -1) for t in a[1]]
    pts += [(t, 2) for t in b[0]] + [(t, -2) for t in b[1]]
    pts.sort(key=_FIRST)
    starts: list[int] = []
    ends: list[int] = []
    state = 0
    for i, (t, d) in enumerate(pts):
        state += d
        if state == 1 and i + 1 < len(pts):
            nxt = pts[i + 1][0]
            if nxt > t:
                starts.append(t)
                ends.append(nxt)
    return merge(starts, ends)


def gaps(iv: Intervals, lo: int, hi: int) -> Intervals:
    """The complement of merged intervals within [lo, hi)."""
    s, e = clip(iv, lo, hi)
    gs = [lo, *e]
    ge = [*s, hi]
    out_s: list[int] = []
    out_e: list[int] = []
    for a, b in zip(gs, ge, strict=True):
        if b > a:
            out_s.append(a)
            out_e.append(b)
    return out_s, out_e


def median(values: Sequence[float]) -> float:
    """Median as numpy computes it (mean of the two middle values for an even count)."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        return float("nan")
    mid = n // 2
    if n % 2:
        return float(v[mid])
    return (float(v[mid - 1]) + float(v[mid])) / 2.0


def mean(values: Sequence[float]) -> float:
    v = [float(x) for x in values]
    return sum(v) / len(v) if v else float("nan")
