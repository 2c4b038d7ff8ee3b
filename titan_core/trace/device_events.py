"""A rank's device events sorted by start, each with its kind and its host launch: what
the per-rank breakdown and the comm ops are both read from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress, islice
from operator import gt
from typing import Any

from titan_core.trace.categories import KIND_CODE, TraceConfig
from titan_core.trace.columns import Events


@dataclass
class GpuEvents:
    """A rank's device events sorted by start (stable), with the host launch of each."""

    ts: list[int]
    end: list[int]
    name: list[str]
    kind: list[int]
    info: list[tuple | None]
    #: start of the host event that launched it (same correlation), or None
    launch_ts: list[int | None]
    #: correlation id of each event; the launches' (correlation, thread) columns
    corr: list[int] = field(default_factory=list)
    launches: tuple[list[int], list[Any]] = ([], [])

    def __len__(self) -> int:
        return len(self.ts)

    def launch_threads(self, events: list[int]) -> list[Any]:
        """The thread that launched each of ``events`` (None without a launch; for a
        repeated correlation, its first launch's). Only comm kernels need threads, so
        only their correlations are looked up."""
        want = {self.corr[i] for i in events}
        corr, tid = self.launches
        keep = list(map(want.__contains__, corr))
        # backwards: a repeated correlation keeps its first launch's thread
        corr, tid = list(compress(corr, keep)), list(compress(tid, keep))
        first = dict(zip(reversed(corr), reversed(tid), strict=True))
        return [first.get(self.corr[i]) for i in events]


def gpu_events(ev: Events, cfg: TraceConfig) -> GpuEvents:
    """``ev``'s device events in start order (ties in file order), with their kinds
    (:data:`~titan_core.trace.categories.KIND_CODE`) and launch times."""
    corr = ev.launch_corr
    l_ts = ev.launch_ts
    l_tid = ev.launch_tid
    # correlation -> start of its launch (threads: GpuEvents.launch_threads, on demand);
    # usually each correlation has one launch, and building the dict backwards keeps the first
    ts_of = dict(zip(reversed(corr), reversed(l_ts), strict=True))
    if len(ts_of) != len(corr):  # repeated correlations: the earliest start
        ts_of = {}
        for c, t in zip(corr, l_ts, strict=True):
            cur = ts_of.get(c)
            if cur is None or t < cur:
                ts_of[c] = t
    ts = ev.dev_ts
    if not ts:
        return GpuEvents([], [], [], [], [], [])
    end = ev.dev_end
    names = ev.dev_name
    info = ev.dev_info
    dcorr = ev.dev_corr
    if any(map(gt, ts, islice(ts, 1, None))):  # stable sort by start: ties keep file order
        order = sorted(range(len(ts)), key=ts.__getitem__)
        ts, end, names, info, dcorr = (
            list(map(col.__getitem__, order)) for col in (ts, end, names, info, dcorr)
        )
    else:  # the columns stay the parsed events' own
        names = list(names)
        info = list(info)
    kind_of = {n: KIND_CODE[cfg.kernel_kind(n)] for n in set(names)}
    return GpuEvents(
        ts=ts,
        end=end,
        name=names,
        kind=list(map(kind_of.__getitem__, names)),
        info=info,
        launch_ts=list(map(ts_of.get, dcorr)),
        corr=dcorr,
        launches=(corr, l_tid),
    )
