"""Parse one Kineto trace file into compact columns, keeping only what the analyses use.

The file's text comes in pieces of whole events (:mod:`titan_core.trace.reader`: inflated
a piece at a time, in bounded memory, with caps on one event's and one file's size), each
decoded in place by msgspec straight into typed structs that name only the
needed fields: events of other phases than "X" (flows, instants, metadata) decode to
empty structs, and the rest of each event (most of ``args``) is skipped without becoming
Python objects; a piece without a single complete event (runs of memory events) is not
decoded at all. Each piece is then sorted into a few small groups and dropped, so neither
the whole text nor all its events are ever alive at once:

- device events (kernels, copies, sets): times, name, correlation, comm args;
- launches: (correlation, start, thread) of host events carrying a correlation id;
- host ranges the analyses look at by name: ``ProfilerStep#N``, ``titan/...`` and host
  comm ranges (``nccl:all_reduce``, ``record_param_comms``...);
- plain CPU ops as (start, end, thread): the compute stream of CPU-only traces (kept only
  when a first read finds no device events and no Titan microbatch ranges).

Everything else (python_function, plain cpu ops, flows, instant events, counters) is
dropped; complete events are counted. Complete events with impossible times (missing,
negative, not numbers, or past 2**53 us) are left out and counted, and the rank warned;
a file without any complete event is an error (an empty rank). A piece whose field
types the typed decoder rejects is decoded as plain objects instead (the slow path).
Nothing here imports numpy or polars. Timestamps
follow HTA's convention (start rounded up, end rounded down to whole microseconds) so
interval sums agree with it. A parse cache (msgpack, keyed by path, mtime, size and
config) makes re-analysis of the same files cheap.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
import string
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any, ClassVar, Generic, TypeVar, Union

import msgspec

from titan_core.trace.categories import TraceConfig
from titan_core.trace.forked import Forked
from titan_core.trace.reader import (
    ReadLimits,
    Rest,
    TraceError,
    TraceLimitError,
    Unsplittable,
    json_outcome,
    kineto_layout,
    read_pieces,
    text_size,
)

CACHE_VERSION = "7"


_Num = int | float | str | None
#: the value of an absent Raw field: one shared instance (Raw is immutable). A
#: ``default_factory`` would be called for every decoded event: about a seventh of the
#: time of decoding a CPU op
_NO_RAW = msgspec.Raw()


class _CommArgs(msgspec.Struct, frozen=True, gc=False):
    """The event args every decode reads (ids, streams and comm metadata).

    Every key of an event's args that is no field here is looked up against all of the
    fields (msgspec scans them in turn), and kernels carry a dozen such keys: so only the
    fields the analyses use, in the order Kineto writes them (a field found right after
    the previous one costs a single comparison)."""

    # ints as Kineto writes them; a file with other types takes the slow path
    stream: int = -1
    correlation: int = -1
    collective: str | None = msgspec.field(default=None, name="Collective name")
    in_nelems: _Num = msgspec.field(default=None, name="In msg nelems")
    out_nelems: _Num = msgspec.field(default=None, name="Out msg nelems")
    group_size: _Num = msgspec.field(default=None, name="Group size")
    dtype: str | None = None
    pg_name: str | int | None = msgspec.field(default=None, name="Process Group Name")
    pg_ranks: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Process Group Ranks")


class _Args(_CommArgs, frozen=True, gc=False):
    input_dims: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Input type")


_NO_ARGS = _Args()


class _LeanArgs(_CommArgs, frozen=True, gc=False):
    """:class:`_Args` without the input shapes, which every CPU op carries and only comm
    ranges without element counts need (for their size): skipping them saves about a fifth
    of the decoding. A piece holding such a range is decoded again with :class:`_Args`
    (see :meth:`_Sorter.add`)."""

    input_dims: ClassVar[msgspec.Raw] = _NO_RAW
    input_type: ClassVar[msgspec.Raw] = _NO_RAW


_NO_LEAN_ARGS = _LeanArgs()

#: times at or past this (microseconds; ~285 years) are impossible, and no longer exact
#: as floats
MAX_TIME_US = 2**53
#: a time as the analyses accept it (whole microseconds stay ints, fractional ones are
#: floats). A missing or impossible one fails the typed decode, so its piece takes the
#: slow path, which leaves such events out and counts them (no check per event here)
_Time = Union[  # noqa: UP007 (Annotated members)
    Annotated[int, msgspec.Meta(ge=0, lt=MAX_TIME_US)],
    Annotated[float, msgspec.Meta(ge=0, lt=MAX_TIME_US)],
]


class _Event(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="X", tag_field="ph"):
    """A complete ("X") event: the only phase the analyses use."""

    cat: str | None = None
    name: str = ""
    tid: int | float | str | None = None
    ts: _Time
    dur: _Time
    args: _Args = _NO_ARGS


class _LeanEvent(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="X", tag_field="ph"):
    """:class:`_Event` with :class:`_LeanArgs`: what pieces of a stream decode to first."""

    cat: str | None = None
    name: str = ""
    tid: int | float | str | None = None
    ts: _Time
    dur: _Time
    args: _LeanArgs = _NO_LEAN_ARGS


#: every other phase (flows, instants, metadata, counters...) decodes to an empty struct:
#: its fields are skipped without becoming objects. A phase outside these single letters
#: fails validation and the file takes the slow path.
_SKIPS = tuple(
    msgspec.defstruct(f"_Skip{c}", [], tag=c, tag_field="ph", frozen=True, gc=False)
    for c in string.ascii_letters
    if c != "X"
)
_AnyEvent = Union[(_Event, *_SKIPS)]  # noqa: UP007 (built at runtime)


_LeanAnyEvent = Union[(_LeanEvent, *_SKIPS)]  # noqa: UP007 (built at runtime)
_E = TypeVar("_E")


class _File(msgspec.Struct, Generic[_E]):
    """The document: its events decoded as ``_E`` (:data:`_AnyEvent` or the lean ones)."""

    traceEvents: list[_E] = []  # noqa: N815 (the file's key)
    distributedInfo: dict[str, Any] | None = None  # noqa: N815
    deviceProperties: list[Any] | None = None  # noqa: N815


#: the document without its events (its header and tail)
_META_DECODER = msgspec.json.Decoder(_File[_LeanAnyEvent])  # type: ignore[valid-type]
_PIECE_DECODER = msgspec.json.Decoder(list[_AnyEvent])  # type: ignore[valid-type]
_LEAN_PIECE_DECODER = msgspec.json.Decoder(list[_LeanAnyEvent])  # type: ignore[valid-type]
#: the slow path's plain objects; a number too large for a float becomes inf (impossible
#: as a time, so flagged) instead of failing the piece
_ANY_DECODER = msgspec.json.Decoder(float_hook=float)

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


_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.I)


def find_trace_files(trace_dir: str | Path) -> list[Path]:
    """All ``*.json`` / ``*.json.gz`` files below ``trace_dir`` (sorted; symlinked folders
    are not followed). ``os.walk`` rather than ``Path.rglob``: the latter's first call
    alone takes a few ms, about what analyzing a small trace does."""
    root = Path(trace_dir)
    if root.is_file():
        return [root]
    files = []
    for folder, _dirs, names in os.walk(root):
        files += [Path(folder, n) for n in names if n.endswith((".json", ".json.gz"))]
    return sorted(p for p in files if p.is_file())


def _int(v: Any, default: int | None = -1) -> int | None:
    if v is None:
        return default
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


class _Sorter:
    """Sorts decoded events into the groups of :class:`Events`, a piece at a time, with
    comprehensions over the piece rather than a Python loop per event."""

    def __init__(self, cfg: TraceConfig, cpu_ops: bool = False) -> None:
        self.ev = Events()
        self.cpu_ops = cpu_ops
        self.gpu_cats = frozenset(cfg.gpu_event_cats)
        self._is_cpu_comm = cfg.is_cpu_comm
        self._seen: set[str] = set()
        self._special: set[str] = set()
        self._comm: set[str] = set()
        #: one object per distinct kept name, category and thread id: a rank's 20k kernel
        #: events carry a few dozen names of ~200 characters, and each decoded event brings
        #: its own copy (megabytes of duplicates to keep, and to hash again in the analysis)
        self._strings: dict[str, str] = {}
        self._threads: dict[Any, Any] = {}
        #: device event names, and those of them named like host ranges of interest
        #: (``gpu_user_annotation`` copies of ``ProfilerStep#N``): checked once per name
        self._dev_names: dict[str, str] = {}
        self._dev_special: set[str] = set()

    def _classify(self, names: set[str]) -> None:
        new = names - self._seen
        if not new:
            return
        self._seen |= new
        for n in new:
            comm = self._is_cpu_comm(n)
            if comm:
                self._comm.add(n)
            if comm or n.startswith(_SPECIAL):
                self._special.add(n)

    def decode_piece(self, piece: memoryview) -> None:
        """Decode and sort in a piece of whole events (``[ev, ..., ev]``); a piece whose
        field types the typed decoder rejects is decoded as plain objects instead."""
        try:
            events = _LEAN_PIECE_DECODER.decode(piece)
        except msgspec.ValidationError:
            self.add(_structs_from_dicts(_ANY_DECODER.decode(piece)))
        else:
            self.add(events, piece)

    def add(self, events: list[Any], piece: Any = None) -> None:
        """Sort one piece's decoded events in. With ``piece`` (the JSON text they came
        from), the events were decoded leanly (:class:`_LeanEvent`: no input shapes); the
        piece is decoded again with every field (:class:`_Event`) only when a host comm
        range in it may need its input shapes for its size (no element counts in its
        args, and input shapes somewhere in the piece). Without it they came the slow way
        (:func:`_structs_from_dicts`) and their times are checked one by one (the typed
        decoders accept possible times only)."""
        ev = self.ev
        x_cls = _Event if piece is None else _LeanEvent
        # complete events with a category ("Trace" is the profiler's own span), then
        # those of them with possible times
        xs = [e for e in events if e.__class__ is x_cls and e.cat is not None and e.cat != "Trace"]
        if piece is None:
            xs = self._drop_impossible(xs)
        ev.n_events += len(xs)
        gpu_cats = self.gpu_cats
        dev = [e for e in xs if e.cat in gpu_cats]
        host = [e for e in xs if e.cat not in gpu_cats] if dev else xs
        self._classify({e.name for e in host})
        comm, special = self._comm, self._special
        if self.cpu_ops:
            ops = [e for e in host if e.cat == "cpu_op" and e.name not in comm]
            _extend_times(ev.ops_ts, [e.ts for e in ops], math.ceil)
            _extend_times(ev.ops_end, [e.ts + e.dur for e in ops], math.floor)
            ev.ops_tid.extend(_one_each(self._threads, [e.tid for e in ops]))
        # plain cpu ops are no launches, ranges of interest or device events
        rest = [e for e in host if e.cat != "cpu_op" or e.name in comm]
        if not ev.has_stream:
            ev.has_stream = any(e.args.stream >= 0 for e in dev) or any(
                e.args.stream >= 0 for e in rest
            )
        launch = [e for e in rest if (a := e.args).correlation >= 0 and a.stream < 0]
        if launch:
            ev.launch_corr.extend([e.args.correlation for e in launch])
            _extend_times(ev.launch_ts, [e.ts for e in launch], math.ceil)
            ev.launch_tid.extend(_one_each(self._threads, [e.tid for e in launch]))
        args = [e.args for e in dev]
        dev_names = self._dev_names
        known = len(dev_names)
        names = list(_one_each(dev_names, [e.name for e in dev]))
        if len(dev_names) > known:
            new_names = list(dev_names)[known:]
            self._dev_special.update(n for n in new_names if n.startswith(_SPECIAL))
        hs = [e for e in dev if e.name in self._dev_special] if self._dev_special else []
        if special:
            hs += [e for e in rest if e.name in special]
        hs_args = [e.args for e in hs]
        lean = piece is not None
        if (
            lean
            and any(
                e.name in comm
                and e.cat not in gpu_cats
                and e.args.in_nelems is None
                and e.args.out_nelems is None
                for e in hs
            )
            and _INPUT_DIMS in bytes(piece)  # rare: a copy is fine
        ):
            whole = _PIECE_DECODER.decode(piece)
            at = {id(e): i for i, e in enumerate(events)}
            args = [whole[at[id(e)]].args for e in dev]
            hs_args = [whole[at[id(e)]].args for e in hs]
            lean = False
        if dev:
            _extend_times(ev.dev_ts, [e.ts for e in dev], math.ceil)
            _extend_times(ev.dev_end, [e.ts + e.dur for e in dev], math.floor)
            ev.dev_name.extend(names)
            ev.dev_corr.extend([a.correlation for a in args])
            ev.dev_info.extend(
                [
                    _info(a, True)
                    if a.collective is not None
                    or a.pg_name is not None
                    or (not lean and len(a.input_dims))
                    else None
                    for a in args
                ]
            )
        if hs:
            _extend_times(ev.host_ts, [e.ts for e in hs], math.ceil)
            _extend_times(ev.host_end, [e.ts + e.dur for e in hs], math.floor)
            ev.host_name.extend(_one_each(self._strings, [e.name for e in hs]))
            ev.host_cat.extend(_one_each(self._strings, [e.cat for e in hs]))
            ev.host_tid.extend(_one_each(self._threads, [e.tid for e in hs]))
            if lean:  # no input shapes: only comm metadata makes an info
                infos = [
                    _info(a, False) if a.collective is not None or a.pg_name is not None else None
                    for a in hs_args
                ]
            else:
                infos = [
                    _info(a, e.cat in gpu_cats or e.name in comm)
                    for e, a in zip(hs, hs_args, strict=True)
                ]
            ev.host_info.extend(infos)

    def _drop_impossible(self, xs: list[Any]) -> list[Any]:
        """``xs`` without the events whose times are missing or impossible (NaN fails
        every comparison), counted in :attr:`Events.n_bad_times`."""
        ok = [e for e in xs if 0 <= e.ts < MAX_TIME_US and 0 <= e.dur < MAX_TIME_US]
        if len(ok) < len(xs):
            ev = self.ev
            ev.n_bad_times += len(xs) - len(ok)
            if not ev.bad_time_example:
                kept = {id(e) for e in ok}
                e = next(e for e in xs if id(e) not in kept)
                ev.bad_time_example = f"{e.name[:80]!r} (ts={_short(e.ts)}, dur={_short(e.dur)})"
        return ok


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 24 else r[:21] + "..."


_INPUT_DIMS = b'"Input Dims"'
#: name prefixes of the ranges the analyses look at besides comm ranges
_SPECIAL = ("ProfilerStep", "titan/")


def _one_each(table: dict[Any, Any], values: Sequence[Any]) -> Iterator[Any]:
    """``values`` with each repeated value replaced by the one object ``table`` keeps."""
    return map(table.setdefault, values, values)


def _extend_times(col: list[int], values: Sequence[Any], rounding: Callable[[Any], int]) -> None:
    """Append times in microseconds: whole ones (what Kineto writes) as they are,
    fractional ones rounded as HTA does (starts up with ``math.ceil``, ends down with
    ``math.floor``)."""
    if type(sum(values)) is int:
        col.extend(values)
    else:
        col.extend(map(rounding, values))


def _info(a: _Args | _LeanArgs, dims: bool) -> tuple | None:
    if a is _NO_ARGS or a is _NO_LEAN_ARGS:
        return None
    has_comm = a.collective is not None or a.pg_name is not None
    has_dims = dims and len(a.input_dims) > 0
    if not (has_comm or has_dims):
        return None
    if has_comm:
        c: tuple = (
            a.collective,
            _int(a.in_nelems, None),
            _int(a.out_nelems, None),
            _int(a.group_size, None),
            a.dtype,
            None if a.pg_name is None else str(a.pg_name),
            bytes(a.pg_ranks).decode() or None,
        )
    else:
        c = (None,) * 7
    if has_dims:
        return (*c, bytes(a.input_dims).decode(), bytes(a.input_type).decode() or None)
    return (*c, None, None)


def _structs_from_dicts(events: list[Any]) -> list[_Event]:
    """Slow path for files whose field types the typed decoder rejects."""

    def raw(v: Any) -> msgspec.Raw:
        return msgspec.Raw() if v is None else msgspec.Raw(msgspec.json.encode(v))

    structs = []
    for e in events:
        if not isinstance(e, dict):
            continue
        a = e.get("args")
        args = _NO_ARGS
        if isinstance(a, dict):
            pg = a.get("Process Group Name")
            stream = a.get("stream")
            args = _Args(
                correlation=_int(a.get("correlation")),  # type: ignore[arg-type]
                stream=_int(stream if isinstance(stream, (int, float, str)) else None),  # type: ignore[arg-type]
                collective=str(a["Collective name"]) if "Collective name" in a else None,
                in_nelems=a.get("In msg nelems"),
                out_nelems=a.get("Out msg nelems"),
                group_size=a.get("Group size"),
                dtype=str(a["dtype"]) if "dtype" in a else None,
                pg_name=None if pg is None else str(pg),
                pg_ranks=raw(a.get("Process Group Ranks")),
                input_dims=raw(a.get("Input Dims")),
                input_type=raw(a.get("Input type")),
            )
        if e.get("ph") != "X":
            continue
        structs.append(
            _Event(
                cat=e.get("cat"),
                name=str(e.get("name", "")),
                tid=e.get("tid") if isinstance(e.get("tid"), (int, float, str)) else None,
                ts=_time(e.get("ts")),
                dur=_time(e.get("dur")),
                args=args,
            )
        )
    return structs


def _time(v: Any) -> int | float:
    """A time as the file gives it if it is a number, else NaN (then flagged as
    impossible: a string is no time, even one that reads as a number)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    return math.nan


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic GC off for a stretch of parsing or analysis: it allocates hundreds of
    thousands of objects and frees them by reference counting (no cycles), so the GC
    would only rescan the growing columns over and over. Nests; restores the old state."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _limits(cfg: TraceConfig) -> ReadLimits:
    return ReadLimits(max_event_bytes=cfg.max_event_bytes, max_text_bytes=cfg.max_trace_bytes)


def _doc_error(exc: msgspec.DecodeError, offset: int) -> TraceError:
    """The error for a document (header or tail) that does not decode."""
    if json_outcome(exc, offset) == "truncated":  # raises for malformed text
        return TraceError("truncated JSON: the text ends inside the trace (a file cut short?)")
    return TraceError(f"not valid JSON: text after the end of the document (from byte {offset})")


def _doc_meta(text: bytes, offset: int) -> tuple[Any, Any]:
    """(distributedInfo, deviceProperties) of a document without events (the header or
    the tail of a trace, its text starting at text offset ``offset``); None when absent."""
    try:
        doc = _META_DECODER.decode(text)
        return doc.distributedInfo, doc.deviceProperties
    except msgspec.ValidationError:  # odd types: the slow way, keeping what fits
        pass
    except msgspec.DecodeError as exc:
        raise _doc_error(exc, offset) from None
    try:
        raw = _ANY_DECODER.decode(text)
    except msgspec.DecodeError as exc:
        raise _doc_error(exc, offset) from None
    if not isinstance(raw, dict):
        raise TraceError("not a Kineto trace (the document is no JSON object)")
    dist, props = raw.get("distributedInfo"), raw.get("deviceProperties")
    return (dist if isinstance(dist, dict) else None), (props if isinstance(props, list) else None)


def _finish(rest: Rest) -> tuple[Any, Any]:
    """The document's distributedInfo and deviceProperties (None when absent)."""
    head_dist, head_props = _doc_meta(rest.header, 0)
    dist, props = _doc_meta(rest.tail, rest.tail_offset)
    return (dist if dist is not None else head_dist), (props if props is not None else head_props)


#: a file whose text is at least this large is decoded by several processes at once when
#: there are cores to spare (forking one and sending its columns back costs a few ms, what
#: decoding ~1 MB of text takes)
SPLIT_MIN_TEXT_BYTES = 4 << 20


def _stream_part(p: Path, cfg: TraceConfig, cpu_ops: bool, lo: int, hi: int | None) -> bytes:
    """A forked helper's share of :func:`_stream_split`: its events and, when it read the
    text's end, the document's metadata, packed (or the error, which the parent
    re-raises)."""
    gc.disable()
    try:
        sorter = _Sorter(cfg, cpu_ops)
        rest = read_pieces(p, sorter.decode_piece, _limits(cfg), True, lo, hi)
        meta = None if rest is None else _finish(rest)
        return _CACHE_ENC.encode((sorter.ev.to_builtins(), meta))
    except BaseException as exc:
        return _CACHE_ENC.encode((None, f"{type(exc).__name__}\0{exc}"))


#: the share of a split file's text this process decodes, relative to each helper's (at
#: 1.2 the helper finished after this process in nearly every timed run; 1.5 took 2-4%
#: less time on the shared traces, measured over 16-30 interleaved runs)
_OWN_SHARE = 1.5
_HELPER_ERRORS = {c.__name__: c for c in (TraceError, TraceLimitError, Unsplittable)}


def _stream_split(p: Path, cfg: TraceConfig, cpu_ops: bool, parts: int) -> tuple[Events, Any]:
    """The pieces of a file in Kineto's layout over ``parts`` processes: this one decodes
    the first range of the text while forked helpers decode the others; their columns are
    appended in order. The helpers are forked (:class:`~titan_core.trace.forked.Forked`).
    Returns the columns and the document's (distributedInfo, deviceProperties)."""
    size = text_size(p)
    # this process takes a larger share: each helper also inflates the text before its
    # range and packs its columns, while this one only unpacks them
    weights = [_OWN_SHARE] + [1.0] * (parts - 1)
    total = sum(weights)
    bounds: list[int | None] = [int(size * sum(weights[:i]) / total) for i in range(parts)]
    bounds.append(None)
    helpers: list[Forked] = []
    try:
        for i in range(1, parts):
            work = partial(_stream_part, p, cfg, cpu_ops, bounds[i], bounds[i + 1])
            helpers.append(Forked(work))
        sorter = _Sorter(cfg, cpu_ops)
        rest = read_pieces(p, sorter.decode_piece, _limits(cfg), True, 0, bounds[1])
        metas = [None if rest is None else _finish(rest)]
        for helper in helpers:
            data = helper.result()
            if not data:
                raise TraceError("a parsing helper process died")
            ev, meta = _CACHE_DEC.decode(data)
            if ev is None:
                kind, _, msg = meta.partition("\0")
                if kind not in _HELPER_ERRORS:
                    msg = f"{kind}: {msg}"
                raise _HELPER_ERRORS.get(kind, TraceError)(msg)
            sorter.ev.extend(Events.from_builtins(ev))
            metas.append(meta)
    finally:
        for helper in helpers:
            helper.close()
    meta = next((m for m in metas if m is not None), None)
    if meta is None:
        raise TraceError("no traceEvents array (truncated or not a Kineto trace)")
    return sorter.ev, meta


def _parse(p: Path, cfg: TraceConfig, cpu_ops: bool, parts: int = 1) -> tuple[Events, Any, Any]:
    kineto = kineto_layout(p)
    if parts > 1 and kineto and text_size(p) >= SPLIT_MIN_TEXT_BYTES:
        try:
            events, (dist, props) = _stream_split(p, cfg, cpu_ops, parts)
            return events, dist or {}, props or []
        except Unsplittable:
            pass  # boundaries that need confirming one by one: read in this process
    sorter = _Sorter(cfg, cpu_ops)
    rest = read_pieces(p, sorter.decode_piece, _limits(cfg), kineto)
    assert rest is not None  # a reader without a range reads to the end
    dist, props = _finish(rest)
    return sorter.ev, dist or {}, props or []


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
    rank = _int(dist.get("rank"), None) if isinstance(dist, dict) else None
    if rank is None:
        m = _RANK_IN_NAME.search(p.name)
        if m:
            rank = int(m.group(1))
            warnings.append("no rank in distributedInfo; rank taken from the file name")
    meta = {
        "backend": dist.get("backend") if isinstance(dist, dict) else None,
        "world_size": _int(dist.get("world_size"), None) if isinstance(dist, dict) else None,
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


# ----------------------------------------------------------------------------- cache

_CACHE_ENC = msgspec.msgpack.Encoder()
_CACHE_DEC = msgspec.msgpack.Decoder()


def cache_key(path: str | Path) -> str:
    import hashlib

    p = Path(path).resolve()
    st = p.stat()
    key = f"{CACHE_VERSION}|{p}|{st.st_mtime_ns}|{st.st_size}"
    return hashlib.sha1(key.encode()).hexdigest()


def load_cached(
    path: str | Path,
    cfg: TraceConfig | None = None,
    cache_dir: str | Path | None = None,
    parts: int = 1,
) -> RankTrace:
    """:func:`parse_file` through the parse cache (when ``cache_dir`` is given)."""
    if cache_dir is None:
        return parse_file(path, cfg, parts)
    import hashlib

    cfg_key = hashlib.sha1(json.dumps(cfg.to_dict() if cfg else {}, sort_keys=True).encode())
    key = cache_key(path) + cfg_key.hexdigest()[:8]
    target = Path(cache_dir) / f"{key}.msgpack"
    if target.exists():
        try:
            info = _CACHE_DEC.decode(target.read_bytes())
            return RankTrace(
                info["path"],
                info["rank"],
                info["meta"],
                Events.from_builtins(info["events"]),
                info["warnings"],
            )
        except Exception:  # a damaged cache entry is just re-parsed
            pass
    rt = parse_file(path, cfg, parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(
        _CACHE_ENC.encode(
            {
                "path": rt.path,
                "rank": rt.rank,
                "meta": rt.meta,
                "warnings": rt.warnings,
                "events": rt.events.to_builtins(),
            }
        )
    )
    os.replace(tmp, target)
    return rt
