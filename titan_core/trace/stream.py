"""One file's text decoded into columns: the pieces of whole events the reader hands on
(:mod:`titan_core.trace.reader`) go through a :class:`~titan_core.trace.sorter.Sorter`,
in this process or split over forked helpers that each decode a range of the text, and
the document's header and tail give its ``distributedInfo`` and ``deviceProperties``.
"""

from __future__ import annotations

import gc
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from titan_core.trace.categories import TraceConfig
from titan_core.trace.columns import Events
from titan_core.trace.forked import Forked
from titan_core.trace.reader import (
    ReadLimits,
    Rest,
    TraceError,
    TraceLimitError,
    Unsplittable,
    json_outcome,
    read_pieces,
    text_size,
)
from titan_core.trace.schema import ANY_DECODER, META_DECODER
from titan_core.trace.sorter import Sorter

#: packs a helper's columns for the parent
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


def read_events(p: Path, cfg: TraceConfig, cpu_ops: bool, kineto: bool) -> tuple[Events, Any, Any]:
    """The kept events of ``p`` (plain CPU ops too with ``cpu_ops``), decoded in this
    process, and the document's distributedInfo (``{}`` when absent) and
    deviceProperties (``[]``). ``kineto``: the text is in the profiler's layout."""
    sorter = Sorter(cfg, cpu_ops)
    rest = read_pieces(p, sorter.decode_piece, _limits(cfg), kineto)
    assert rest is not None  # a reader without a range reads to the end
    dist, props = _finish(rest)
    return sorter.ev, dist or {}, props or []


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
        doc = META_DECODER.decode(text)
        return doc.distributedInfo, doc.deviceProperties
    except msgspec.ValidationError:  # odd types: the slow way, keeping what fits
        pass
    except msgspec.DecodeError as exc:
        raise _doc_error(exc, offset) from None
    try:
        raw = ANY_DECODER.decode(text)
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


def _read_part(p: Path, cfg: TraceConfig, cpu_ops: bool, lo: int, hi: int | None) -> bytes:
    """A forked helper's share of :func:`read_events_split`: its events and, when it read
    the text's end, the document's metadata, packed (or the error, which the parent
    re-raises)."""
    gc.disable()
    try:
        sorter = Sorter(cfg, cpu_ops)
        rest = read_pieces(p, sorter.decode_piece, _limits(cfg), True, lo, hi)
        meta = None if rest is None else _finish(rest)
        return _ENC.encode((sorter.ev.to_builtins(), meta))
    except BaseException as exc:
        return _ENC.encode((None, f"{type(exc).__name__}\0{exc}"))


#: the share of a split file's text this process decodes, relative to each helper's (at
#: 1.2 the helper finished after this process in nearly every timed run; 1.5 took 2-4%
#: less time on the shared traces, measured over 16-30 interleaved runs)
_OWN_SHARE = 1.5
_HELPER_ERRORS = {c.__name__: c for c in (TraceError, TraceLimitError, Unsplittable)}


def read_events_split(
    p: Path, cfg: TraceConfig, cpu_ops: bool, parts: int
) -> tuple[Events, Any, Any]:
    """:func:`read_events` for a file in Kineto's layout, over ``parts`` processes: this
    one decodes the first range of the text while forked helpers
    (:class:`~titan_core.trace.forked.Forked`) decode the others; their columns are
    appended in order. Raises :class:`Unsplittable` for text whose boundaries need
    confirming one by one (then read it with :func:`read_events`)."""
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
            work = partial(_read_part, p, cfg, cpu_ops, bounds[i], bounds[i + 1])
            helpers.append(Forked(work))
        sorter = Sorter(cfg, cpu_ops)
        rest = read_pieces(p, sorter.decode_piece, _limits(cfg), True, 0, bounds[1])
        metas = [None if rest is None else _finish(rest)]
        for helper in helpers:
            data = helper.result()
            if not data:
                raise TraceError("a parsing helper process died")
            ev, meta = _DEC.decode(data)
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
    dist, props = meta
    return sorter.ev, dist or {}, props or []
