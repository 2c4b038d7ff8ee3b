"""What a Kineto trace's text decodes to: typed msgspec structs naming only the fields
the analyses use, and the slow path for text whose field types they reject.

Events of other phases than "X" (flows, instants, metadata) decode to empty structs, and
the rest of each event (most of ``args``) is skipped without becoming Python objects.
Missing or impossible times fail the typed decode; the slow path (plain objects, then
:func:`structs_from_dicts`) keeps them as NaN or their value, for the sorter to leave out
and count.
"""

from __future__ import annotations

import math
import string
from typing import Annotated, Any, ClassVar, Generic, TypeVar, Union

import msgspec

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


class Args(_CommArgs, frozen=True, gc=False):
    input_dims: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Input type")


NO_ARGS = Args()


class LeanArgs(_CommArgs, frozen=True, gc=False):
    """:class:`Args` without the input shapes, which every CPU op carries and only comm
    ranges without element counts need (for their size): skipping them saves about a fifth
    of the decoding. A piece holding such a range is decoded again with :class:`Args`
    (see :meth:`titan_core.trace.sorter.Sorter.add`)."""

    input_dims: ClassVar[msgspec.Raw] = _NO_RAW
    input_type: ClassVar[msgspec.Raw] = _NO_RAW


NO_LEAN_ARGS = LeanArgs()

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


class Event(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="X", tag_field="ph"):
    """A complete ("X") event: the only phase the analyses use."""

    cat: str | None = None
    name: str = ""
    tid: int | float | str | None = None
    ts: _Time
    dur: _Time
    args: Args = NO_ARGS


class LeanEvent(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="X", tag_field="ph"):
    """:class:`Event` with :class:`LeanArgs`: what pieces of a stream decode to first."""

    cat: str | None = None
    name: str = ""
    tid: int | float | str | None = None
    ts: _Time
    dur: _Time
    args: LeanArgs = NO_LEAN_ARGS


#: every other phase (flows, instants, metadata, counters...) decodes to an empty struct:
#: its fields are skipped without becoming objects. A phase outside these single letters
#: fails validation and the file takes the slow path.
_SKIPS = tuple(
    msgspec.defstruct(f"_Skip{c}", [], tag=c, tag_field="ph", frozen=True, gc=False)
    for c in string.ascii_letters
    if c != "X"
)
_AnyEvent = Union[(Event, *_SKIPS)]  # noqa: UP007 (built at runtime)


_LeanAnyEvent = Union[(LeanEvent, *_SKIPS)]  # noqa: UP007 (built at runtime)
_E = TypeVar("_E")


class _File(msgspec.Struct, Generic[_E]):
    """The document: its events decoded as ``_E`` (:data:`_AnyEvent` or the lean ones)."""

    traceEvents: list[_E] = []  # noqa: N815 (the file's key)
    distributedInfo: dict[str, Any] | None = None  # noqa: N815
    deviceProperties: list[Any] | None = None  # noqa: N815


#: the document without its events (its header and tail)
META_DECODER = msgspec.json.Decoder(_File[_LeanAnyEvent])  # type: ignore[valid-type]
PIECE_DECODER = msgspec.json.Decoder(list[_AnyEvent])  # type: ignore[valid-type]
LEAN_PIECE_DECODER = msgspec.json.Decoder(list[_LeanAnyEvent])  # type: ignore[valid-type]
#: the slow path's plain objects; a number too large for a float becomes inf (impossible
#: as a time, so flagged) instead of failing the piece
ANY_DECODER = msgspec.json.Decoder(float_hook=float)


def as_int(v: Any, default: int | None = -1) -> int | None:
    """``v`` as an int (ids and counts some files write as strings or floats), else
    ``default``."""
    if v is None:
        return default
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def structs_from_dicts(events: list[Any]) -> list[Event]:
    """Slow path for files whose field types the typed decoder rejects."""

    def raw(v: Any) -> msgspec.Raw:
        return msgspec.Raw() if v is None else msgspec.Raw(msgspec.json.encode(v))

    structs = []
    for e in events:
        if not isinstance(e, dict):
            continue
        a = e.get("args")
        args = NO_ARGS
        if isinstance(a, dict):
            pg = a.get("Process Group Name")
            stream = a.get("stream")
            args = Args(
                correlation=as_int(a.get("correlation")),  # type: ignore[arg-type]
                stream=as_int(stream if isinstance(stream, (int, float, str)) else None),  # type: ignore[arg-type]
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
            Event(
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
