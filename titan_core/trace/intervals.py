"""Interval arithmetic on plain lists: unions and per-combination coverage.

All analyses reduce to "how long was at least one event of set A running, and did it
overlap set B". Events are half-open [start, end) intervals in integer microseconds.
Pure Python (sorts and one sweep each): fast enough for a rank's events, and it keeps
numpy off the analyzer's path.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from itertools import islice
from operator import gt, itemgetter

Intervals = tuple[list[int], list[int]]

_FIRST = itemgetter(0)


def merge(starts: Sequence[int], ends: Sequence[int]) -> Intervals:
    """Union of intervals as sorted, disjoint (start, end) lists."""
    out_s: list[int] = []
    out_e: list[int] = []
    if len(starts) == 0:
        return out_s, out_e
    # device events come sorted by start: then the sort (and its tuples) is skipped;
    # equal starts may come in any order
    pairs: Iterable[tuple[int, int]]
    if any(map(gt, starts, islice(starts, 1, None))):
        pairs = sorted(zip(starts, ends, strict=True))
        cur_s, cur_e = pairs[0]
    else:
        pairs = zip(starts, ends, strict=True)
        cur_s, cur_e = starts[0], ends[0]
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
