"""Sorts the decoded events of each piece of a trace into the columns of
:class:`~titan_core.trace.columns.Events`, a piece at a time, so that neither the whole
text nor all its events are ever alive at once.

Kept: device events (kernels, copies, sets: times, name, correlation, comm args);
launches (correlation, start, thread of host events carrying a correlation id); the host
ranges the analyses look at by name (``ProfilerStep#N``, ``titan/...`` and host comm
ranges such as ``nccl:all_reduce`` or ``record_param_comms``); and, on request, plain CPU
ops as (start, end, thread), the compute stream of CPU-only traces. Everything else
(python_function, plain cpu ops, flows, instant events, counters) is dropped; complete
events are counted. Times follow HTA's convention (start rounded up, end rounded down to
whole microseconds) so interval sums agree with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from titan_core.trace.categories import TraceConfig
from titan_core.trace.columns import Events
from titan_core.trace.schema import (
    ANY_DECODER,
    LEAN_PIECE_DECODER,
    MAX_TIME_US,
    NO_ARGS,
    NO_LEAN_ARGS,
    PIECE_DECODER,
    Args,
    Event,
    LeanArgs,
    LeanEvent,
    as_int,
    structs_from_dicts,
)


class Sorter:
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
            events = LEAN_PIECE_DECODER.decode(piece)
        except msgspec.ValidationError:
            self.add(structs_from_dicts(ANY_DECODER.decode(piece)))
        else:
            self.add(events, piece)

    def add(self, events: list[Any], piece: Any = None) -> None:
        """Sort one piece's decoded events in. With ``piece`` (the JSON text they came
        from), the events were decoded leanly (:class:`LeanEvent`: no input shapes); the
        piece is decoded again with every field (:class:`Event`) only when a host comm
        range in it may need its input shapes for its size (no element counts in its
        args, and input shapes somewhere in the piece). Without it they came the slow way
        (:func:`structs_from_dicts`) and their times are checked one by one (the typed
        decoders accept possible times only)."""
        ev = self.ev
        x_cls = Event if piece is None else LeanEvent
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
            whole = PIECE_DECODER.decode(piece)
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


def _info(a: Args | LeanArgs, dims: bool) -> tuple | None:
    if a is NO_ARGS or a is NO_LEAN_ARGS:
        return None
    has_comm = a.collective is not None or a.pg_name is not None
    has_dims = dims and len(a.input_dims) > 0
    if not (has_comm or has_dims):
        return None
    if has_comm:
        c: tuple = (
            a.collective,
            as_int(a.in_nelems, None),
            as_int(a.out_nelems, None),
            as_int(a.group_size, None),
            a.dtype,
            None if a.pg_name is None else str(a.pg_name),
            bytes(a.pg_ranks).decode() or None,
        )
    else:
        c = (None,) * 7
    if has_dims:
        return (*c, bytes(a.input_dims).decode(), bytes(a.input_type).decode() or None)
    return (*c, None, None)
