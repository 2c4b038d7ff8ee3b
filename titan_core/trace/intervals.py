"""Interval arithmetic on plain lists: unions and per-combination coverage.

All analyses reduce to "how long was at least one event of set A running, and did it
overlap set B". Events are half-open [start, end) intervals in integer microseconds.
Pure Python (sorts and one sweep each): fast enough for a rank's events, and it keeps
numpy off the analyzer's path.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from itertools import islice
from operator import gt, itemgetter

Intervals = tuple[list[int], list[int]]

_FIRST = itemgetter(0)


def merge(starts: Sequence[int], ends: Sequence[int]) -> Intervals:
    """Union of intervals as sorted, disjoint (start, end) lists."""
    if len(starts) == 0:
        return [], []
    # device events come sorted by start: then the sort (and its tuples) is skipped;
    # equal starts may come in any order
    out: Intervals = ([], [])
    if any(map(gt, starts, islice(starts, 1, None))):
        pairs = sorted(zip(starts, ends, strict=True))
        last = _sweep(iter(pairs), *pairs[0], out)
    else:
        last = _sweep(zip(starts, ends, strict=True), starts[0], ends[0], out)
    return _close(out, last)


def merge_with_prefix(starts: Sequence[int], ends: Sequence[int], n: int) -> tuple[Intervals, int]:
    """:func:`merge` of intervals sorted by start, and in the same sweep the total length
    of the union of the first ``n`` of them."""
    if len(starts) == 0:
        return ([], []), 0
    pairs = zip(starts, ends, strict=True)
    out: Intervals = ([], [])
    cur_s, cur_e = _sweep(islice(pairs, n), starts[0], ends[0], out)
    head = total(out) + max(0, cur_e - cur_s) if n else 0
    return _close(out, _sweep(pairs, cur_s, cur_e, out)), head


def _sweep(
    pairs: Iterator[tuple[int, int]], cur_s: int, cur_e: int, out: Intervals
) -> tuple[int, int]:
    """Extend the union ``out`` by start-sorted ``pairs``, the interval still open being
    [cur_s, cur_e); returns the one open after them."""
    out_s, out_e = out
    for s, e in pairs:
        if s > cur_e:
            if cur_e > cur_s:
                out_s.append(cur_s)
                out_e.append(cur_e)
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    return cur_s, cur_e


def _close(out: Intervals, last: tuple[int, int]) -> Intervals:
    """``out`` with the last open interval appended (unless empty)."""
    if last[1] > last[0]:
        out[0].append(last[0])
        out[1].append(last[1])
    return out


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
    # merged intervals neither overlap nor touch: only the gaps at the ends can be empty
    gs = [lo, *e]
    ge = [*s, hi]
    if ge[-1] <= gs[-1]:
        del gs[-1], ge[-1]
    if ge and ge[0] <= gs[0]:
        del gs[0], ge[0]
    return gs, ge


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
