"""Parse one Kineto trace file into a :class:`RankTrace`: its rank, metadata and the
compact columns of the events the analyses use.

The work is done by modules with one job each, in this order:

- :mod:`~titan_core.trace.reader`: the text, inflated a piece at a time in bounded memory
  (caps on one event's and one file's size), cut into pieces of whole events;
- :mod:`~titan_core.trace.schema`: what a piece decodes to (typed msgspec structs naming
  only the needed fields; a piece whose field types they reject takes the slow path);
- :mod:`~titan_core.trace.sorter`: each decoded piece sorted into the columns of
  :class:`~titan_core.trace.columns.Events` and dropped, so neither the whole text nor
  all its events are ever alive at once;
- :mod:`~titan_core.trace.stream`: one file through the above, in this process or split
  over forked helpers, and the document's metadata;
- :mod:`~titan_core.trace.cache`: the parse cache on disk (:func:`load_cached`).

Complete events with impossible times (missing, negative, not numbers, or past 2**53 us)
are left out and counted, and the rank warned; a file without any complete event is an
error (an empty rank). Nothing here imports numpy or polars.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from titan_core.trace.categories import TraceConfig
from titan_core.trace.columns import Events, RankTrace
from titan_core.trace.gc_pause import gc_paused
from titan_core.trace.reader import TraceError, Unsplittable, kineto_layout, text_size
from titan_core.trace.schema import as_int
from titan_core.trace.stream import read_events, read_events_split

__all__ = [
    "SUMMARY_FORMAT",
    "Events",
    "RankTrace",
    "TraceError",
    "find_trace_files",
    "is_own_report",
    "parse_file",
]

#: a file whose text is at least this large is decoded by several processes at once when
#: there are cores to spare (forking one and sending its columns back costs a few ms, what
#: decoding ~1 MB of text takes)
SPLIT_MIN_TEXT_BYTES = 4 << 20

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.I)


#: the first key of the analyzer's own ``summary.json``, by which it knows its reports
SUMMARY_FORMAT = "titan-trace-summary/1"
#: how the analyzer's own ``summary.json`` opens: with the format key, or (written before
#: there was one) with its first key, ``num_ranks``; no Kineto trace opens with either
_OWN_REPORT = re.compile(
    rb'^\s*\{\s*"(?:format"\s*:\s*"%s/|num_ranks"\s*:)'
    % re.escape(SUMMARY_FORMAT.partition("/")[0].encode())
)


def is_own_report(path: str | Path) -> bool:
    """Whether ``path`` is a ``summary.json`` the analyzer wrote (never a trace)."""
    if not str(path).endswith(".json"):
        return False  # the analyzer writes its summary uncompressed
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return _OWN_REPORT.match(head) is not None


def find_trace_files(
    trace_dir: str | Path, exclude: tuple[str | Path, ...] | list[str | Path] = ()
) -> list[Path]:
    """All ``*.json`` / ``*.json.gz`` files below ``trace_dir`` (sorted; symlinked folders
    are not followed), but for the folders in ``exclude`` (e.g. the report folder, when it
    lies inside ``trace_dir``; ``trace_dir`` itself is never left out) and the analyzer's
    own reports (:func:`is_own_report`), wherever they are. ``os.walk`` rather than
    ``Path.rglob``: the latter's first call alone takes a few ms, about what analyzing a
    small trace does."""
    root = Path(trace_dir)
    if root.is_file():
        return [root]
    skip = {os.path.realpath(x) for x in exclude} - {os.path.realpath(root)}
    files = []
    for folder, dirs, names in os.walk(root):
        if skip:
            dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(folder, d)) not in skip]
        files += [Path(folder, n) for n in names if n.endswith((".json", ".json.gz"))]
    return sorted(p for p in files if p.is_file() and not is_own_report(p))


def _parse(p: Path, cfg: TraceConfig, cpu_ops: bool, parts: int = 1) -> tuple[Events, Any, Any]:
    kineto = kineto_layout(p)
    if parts > 1 and kineto and text_size(p) >= SPLIT_MIN_TEXT_BYTES:
        try:
            return read_events_split(p, cfg, cpu_ops, parts)
        except Unsplittable:
            pass  # boundaries that need confirming one by one: read in this process
    return read_events(p, cfg, cpu_ops, kineto)


def _parse_any(p: Path, cfg: TraceConfig, parts: int) -> tuple[Events, Any, Any]:
    events, dist, device_props = _parse(p, cfg, cpu_ops=False, parts=parts)
    if not len(events.dev_ts) and not any(
        n.startswith("titan/microbatch/") for n in events.host_name
    ):
        # a CPU-only trace without Titan's ranges: its compute stream is the plain CPU
        # ops, which GPU traces never need; read it again keeping them (such files are small)
        events, dist, device_props = _parse(p, cfg, cpu_ops=True, parts=parts)
    return events, dist, device_props


def parse_file(path: str | Path, cfg: TraceConfig | None = None, parts: int = 1) -> RankTrace:
    """Parse one trace file; raises :class:`TraceError` naming what is wrong with it.

    ``parts`` > 1 lets a large file be decoded by that many processes (forked; Linux only).
    """
    cfg = cfg or TraceConfig()
    p = Path(path)
    warnings: list[str] = []
    if parts > 1 and sys.platform != "linux":  # fork is Linux's safe default only
        parts = 1
    with gc_paused():
        events, dist, device_props = _parse_any(p, cfg, parts)
    if not events.n_events:
        raise TraceError(_empty_reason(events))
    if events.n_bad_times:
        warnings.append(
            f"{events.n_bad_times} complete events with missing or impossible times "
            f"({_IMPOSSIBLE}) left out, e.g. {events.bad_time_example}"
        )
    rank = as_int(dist.get("rank"), None) if isinstance(dist, dict) else None
    if rank is None:
        m = _RANK_IN_NAME.search(p.name)
        if m:
            rank = int(m.group(1))
            warnings.append("no rank in distributedInfo; rank taken from the file name")
    meta = {
        "backend": dist.get("backend") if isinstance(dist, dict) else None,
        "world_size": as_int(dist.get("world_size"), None) if isinstance(dist, dict) else None,
        "pg_config": _pg_config(dist.get("pg_config")) if isinstance(dist, dict) else [],
        "device": _device_kind(device_props, events),
    }
    return RankTrace(str(p), rank, meta, events, warnings)


_IMPOSSIBLE = "negative, not a number, or past 2**53 us"


def _empty_reason(events: Events) -> str:
    if events.n_bad_times:
        return (
            f"empty rank: all {events.n_bad_times} complete events have missing or impossible "
            f"times ({_IMPOSSIBLE}), e.g. {events.bad_time_example}"
        )
    return 'empty rank: no complete ("X") events, nothing to analyze'


def _pg_config(pgs: Any) -> list[dict[str, Any]]:
    out = []
    if isinstance(pgs, list):
        for pg in pgs:
            if isinstance(pg, dict):
                ranks = pg.get("ranks")
                out.append(
                    {
                        "pg_name": str(pg.get("pg_name")),
                        "pg_desc": pg.get("pg_desc"),
                        "ranks": list(ranks) if isinstance(ranks, list) else [],
                    }
                )
    return out


def _device_kind(device_props: list[Any], events: Events) -> str:
    names = " ".join(str(d.get("name", "")) for d in device_props if isinstance(d, dict)).lower()
    if any(k in names for k in ("mi2", "mi3", "amd", "radeon", "instinct")):
        return "rocm"
    if "mtia" in names:
        return "mtia"
    if not events.has_stream:
        return "cpu"
    return "gpu"
