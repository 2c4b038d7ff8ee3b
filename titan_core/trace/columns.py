"""The kept events of one parsed file, as columns (:class:`Events`), and the parsed
file (:class:`RankTrace`): what the parser builds and every per-rank analysis reads.

Columns are plain lists (no numpy, no polars), packed for msgpack with
:meth:`Events.to_builtins` (the parse cache, and columns sent back by the processes that
decode parts of one file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the comm args of an event, in this order (None when the event has none)
COMM_FIELDS = (
    "coll",
    "in_n",
    "out_n",
    "gsize",
    "dtype",
    "pg_name",
    "pg_ranks",
    "in_dims",
    "in_type",
)


@dataclass
class Events:
    """The kept events of one rank, as columns (parallel lists; times in whole
    microseconds, thread ids as the file writes them).

    ``dev_*``: device events in file order; ``host_*``: host ranges looked at by name;
    ``launch_*``: host events carrying a correlation id; ``ops_*``: plain CPU ops.
    ``*_info``: per event, None or the tuple of :data:`COMM_FIELDS`.
    """

    dev_ts: list[int] = field(default_factory=list)
    dev_end: list[int] = field(default_factory=list)
    dev_name: list[str] = field(default_factory=list)
    dev_corr: list[int] = field(default_factory=list)
    dev_info: list[tuple | None] = field(default_factory=list)
    host_ts: list[int] = field(default_factory=list)
    host_end: list[int] = field(default_factory=list)
    host_name: list[str] = field(default_factory=list)
    host_cat: list[str] = field(default_factory=list)
    host_tid: list[Any] = field(default_factory=list)
    host_info: list[tuple | None] = field(default_factory=list)
    launch_corr: list[int] = field(default_factory=list)
    launch_ts: list[int] = field(default_factory=list)
    launch_tid: list[Any] = field(default_factory=list)
    ops_ts: list[int] = field(default_factory=list)
    ops_end: list[int] = field(default_factory=list)
    ops_tid: list[Any] = field(default_factory=list)
    #: any event with a device stream (tells GPU from CPU-only traces)
    has_stream: bool = False
    #: complete ("X") events seen with valid times, kept or not
    n_events: int = 0
    #: complete events left out for missing or impossible times, and the first of them
    n_bad_times: int = 0
    bad_time_example: str = ""

    @property
    def height(self) -> int:
        """Number of kept events (device, host ranges and launches)."""
        return len(self.dev_ts) + len(self.host_ts) + len(self.launch_ts)

    def extend(self, other: Events) -> None:
        """Append ``other``'s events (the next part of the same file) to these."""
        for k, v in self.__dict__.items():
            if isinstance(v, list):
                v.extend(getattr(other, k))
        self.has_stream = self.has_stream or other.has_stream
        self.n_events += other.n_events
        self.n_bad_times += other.n_bad_times
        self.bad_time_example = self.bad_time_example or other.bad_time_example

    def to_builtins(self) -> dict[str, Any]:
        """Plain data for msgpack (parse cache, split parsing). Names, categories and
        thread ids go as a table of distinct values and indices into it (kernel names are
        long and repeat: a fraction of the bytes, and one object per value when unpacked);
        comm args, None for all but a few events, as (count, [(index, args), ...])."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if k in _TABLE_COLUMNS:
                index: dict[Any, int] = {}
                codes = [index.setdefault(x, len(index)) for x in v]
                out[k] = (list(index), codes)
            elif k.endswith("_info"):
                out[k] = (len(v), [(i, x) for i, x in enumerate(v) if x is not None])
            else:
                out[k] = v
        return out

    @classmethod
    def from_builtins(cls, d: dict[str, Any]) -> Events:
        ev = cls()
        for k, v in d.items():
            if k in _TABLE_COLUMNS:
                table, idx = v
                v = list(map(table.__getitem__, idx))
            elif k.endswith("_info"):
                n, given = v
                v = [None] * n
                for i, x in given:  # msgpack gives the tuples back as lists
                    v[i] = tuple(x)
            setattr(ev, k, v)
        return ev


_TABLE_COLUMNS = frozenset(
    {"dev_name", "host_name", "host_cat", "host_tid", "launch_tid", "ops_tid"}
)


@dataclass
class RankTrace:
    """One parsed file: its rank (None if the file carries none), metadata and events."""

    path: str
    rank: int | None
    meta: dict[str, Any]
    events: Events
    warnings: list[str] = field(default_factory=list)
