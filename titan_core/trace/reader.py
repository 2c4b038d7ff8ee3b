"""The text of a Kineto trace as pieces of whole events, read in bounded memory.

A trace is one JSON document ``{..., "traceEvents": [ev, ev, ...], ...}`` that may inflate
to gigabytes, so it is never held whole. The file is inflated (ISA-L when installed, else
zlib) ``PIECE`` bytes at a time into one reused buffer; the buffer is cut after the last
event boundary in it and the run of whole events before the cut is handed on as
``[ev, ..., ev]`` (decoded in place by the caller) and dropped.

Every byte is looked at a bounded number of times: boundaries are searched for only in
newly read text, and text that offers no boundary (one huge event) is checked for JSON
errors only each time it has doubled, so time stays linear in the text and a malformed
file fails at its first bad byte. Two caps bound what one file may cost: ``max_event_bytes``
(text held at once: one event, the document's header or its tail) and ``max_text_bytes``
(the whole text, after inflation: a gzip bomb stops there).

Boundaries: Kineto starts every event on a line ``  {``, so in its layout ``"\\n  },\\n  {"``
marks one (JSON strings hold no raw newline). In any other layout a ``}, {`` is only a
candidate, confirmed by the decode of the piece it ends: cut inside a string or a nested
array, a piece is unterminated ("truncated"), which no piece cut at a true boundary is.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

try:  # ISA-L inflates about 3x faster than zlib; imported here, not per file (~2 ms)
    from isal import isal_zlib as _isal_zlib
except ImportError:  # pragma: no cover - optional speedup
    _isal_zlib = None


class TraceError(Exception):
    """A trace file that cannot be analyzed; the message says why."""


class TraceLimitError(TraceError):
    """A trace larger than a configured cap (``max_event_bytes``, ``max_text_bytes``)."""


class Unsplittable(TraceError):
    """Internal: the text needs boundaries confirmed one after another, which processes
    reading separate ranges of it cannot do; read it in one process instead."""


@dataclass(frozen=True)
class ReadLimits:
    """How much text one file may hold at once (``max_event_bytes``) and in all
    (``max_text_bytes``, after inflation)."""

    max_event_bytes: int
    max_text_bytes: int


@dataclass(frozen=True)
class Rest:
    """The document without its events, as two small documents: ``header`` (the text
    before ``traceEvents``, closed as ``"traceEvents": []}``) and ``tail`` (the text after
    the events array, opened as ``{"traceEvents": []``)."""

    header: bytes
    tail: bytes
    #: the text offset of ``tail``'s first byte were it in the text (for error positions)
    tail_offset: int


#: pieces of about this much text: small ones' buffers and objects are recycled by the
#: allocators instead of being mapped and unmapped (page faults cost more than the extra
#: decode calls; 64 KB measured fastest, also for compact JSON)
PIECE = 1 << 16
GZIP_MAGIC = b"\x1f\x8b"
KINETO_SEP = b"\n  },\n  {"
_TAIL_START = b'{"traceEvents": []'
_KEY = b'"traceEvents"'
_HEADER_END = b'"traceEvents": []}'
_WS = re.compile(rb"[ \t\r\n]*")
_GENERIC_CUT = re.compile(rb"\}[ \t\r\n]*(,)[ \t\r\n]*\Z")
_BYTE_AT = re.compile(r"^(?:JSON is malformed: )?(.*?)(?: \(byte (\d+)\))?$")
_TRUNCATED_MSG = "truncated JSON: the traceEvents array never ends (a file cut short?)"

#: checks text without building objects: values are skipped (and so validated)
_PROBE_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])
_PROBE_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])

_OK, _TRUNCATED, _TRAILING = "ok", "truncated", "trailing"


def gzip_module() -> tuple[Any, tuple[type[Exception], ...]]:
    """ISA-L's zlib-compatible inflater if installed, else zlib (same interface)."""
    if _isal_zlib is None:  # pragma: no cover - optional speedup
        return zlib, (zlib.error,)
    return _isal_zlib, (_isal_zlib.error, zlib.error)


#: the command-line flag (in MiB) of each cap
_FLAG = {"max_trace_bytes": "--max-trace-mb", "max_event_bytes": "--max-event-mb"}


def _too_large(what: str, cap: int, setting: str) -> TraceLimitError:
    return TraceLimitError(
        f"{what} is larger than {setting}={cap} bytes ({cap / 2**20:.0f} MiB); if the file "
        f"is genuine, raise it with {_FLAG[setting]} or {setting} in the trace config (--config)"
    )


def iter_text(path: Path, max_text_bytes: int) -> Iterator[bytes]:
    """The (inflated) text of a trace file in pieces of at most ``PIECE`` bytes; raises
    :class:`TraceLimitError` once it passes ``max_text_bytes``. Gzip files of several
    members (``cat a.gz b.gz``) are read through; bytes after the last member are ignored."""
    with open(path, "rb") as fh:
        head = fh.read(2)
        fh.seek(0)
        if head != GZIP_MAGIC:
            if os.fstat(fh.fileno()).st_size > max_text_bytes:
                raise _too_large("the file", max_text_bytes, "max_trace_bytes")
            while chunk := fh.read(PIECE):
                yield chunk
            return
        zmod, errors = gzip_module()
        d = zmod.decompressobj(wbits=31)
        total = 0
        comp = fh.read(PIECE // 4)
        while comp:
            try:
                piece = d.decompress(comp, PIECE)
                # a full piece may leave output pending even when all input was taken
                while piece:
                    total += len(piece)
                    if total > max_text_bytes:
                        raise _too_large("the inflated text", max_text_bytes, "max_trace_bytes")
                    full = len(piece) == PIECE
                    yield piece
                    tail = d.unconsumed_tail
                    piece = d.decompress(tail, PIECE) if tail or full else b""
            except errors as exc:
                raise TraceError(f"corrupt gzip: {exc}") from exc
            if d.eof:  # the member is complete: another one may follow
                comp = d.unused_data
                if len(comp) < 2:
                    comp += fh.read(PIECE // 4)
                if comp[:2] != GZIP_MAGIC:
                    return
                d = zmod.decompressobj(wbits=31)
            else:
                comp = fh.read(PIECE // 4)
        if not d.eof:
            raise TraceError("truncated gzip stream")


def kineto_layout(path: Path) -> bool:
    """Whether the file is laid out as Kineto writes it (one event starting per line
    ``  {``), judged from its first 64 KB, so that events are cut apart at
    :data:`KINETO_SEP` without confirming each cut."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    if head[:2] == GZIP_MAGIC:
        zmod, errors = gzip_module()
        try:
            head = zmod.decompressobj(wbits=31).decompress(head, 1 << 18)
        except errors:
            return True  # the reader names the problem
    return KINETO_SEP in head


def text_size(path: Path) -> int:
    """The trace's text size: a gzip file's trailer (its size modulo 2**32; only a hint
    for splitting the work), else the file's size."""
    with open(path, "rb") as fh:
        if fh.read(2) != GZIP_MAGIC:
            return os.fstat(fh.fileno()).st_size
        fh.seek(-4, os.SEEK_END)
        return int.from_bytes(fh.read(4), "little")


def json_outcome(exc: msgspec.DecodeError, offset: int) -> str:
    """What a failed decode of text starting at ``offset`` says: ``"truncated"`` (it ends
    inside a value), ``"trailing"`` (a value ended before the text did); raises
    :class:`TraceError` naming the first bad byte for anything else."""
    msg = str(exc)
    if msg.startswith("Input data was truncated"):
        return _TRUNCATED
    if "trailing characters" in msg:
        return _TRAILING
    m = _BYTE_AT.match(msg)
    what, at = (m.group(1), m.group(2)) if m else (msg, None)
    where = f"at byte {offset + int(at)} of the text" if at is not None else f"after byte {offset}"
    raise TraceError(f"not valid JSON {where}: {what}")


def _not_an_object(exc: msgspec.ValidationError) -> TraceError:
    return TraceError(f"not a Kineto trace (the document is no JSON object: {exc})")


class _KeyFinder:
    """Finds ``"traceEvents": [`` in text that arrives in pieces, looking at each byte a
    bounded number of times (a regex search from the start each time would be quadratic
    in a long header)."""

    def __init__(self) -> None:
        self.pos = 0  # text before this was looked at
        self.key = -1  # where a candidate key starts, or -1
        self.colon = False

    def feed(self, buf: bytearray, n: int) -> int | None:
        """The index of the array's ``[`` once ``buf[:n]`` holds it, else None."""
        while True:
            if self.key < 0:
                k = buf.find(_KEY, max(0, self.pos - len(_KEY) + 1), n)
                if k < 0:
                    self.pos = n
                    return None
                self.key, self.pos, self.colon = k, k + len(_KEY), False
            self.pos = _WS.match(buf, self.pos, n).end()  # type: ignore[union-attr]
            if self.pos == n:
                return None
            c = buf[self.pos]
            if c == 0x3A and not self.colon:  # :
                self.colon = True
                self.pos += 1
            elif c == 0x5B and self.colon:  # [
                return self.pos
            else:  # not the key after all: look further
                self.pos, self.key = self.key + 1, -1


def _last_cut(buf: bytearray, start: int, n: int, kineto: bool) -> int:
    """The index of the comma of the last event boundary in ``buf[:n]`` that ends at or
    after ``start`` (the text before was searched already), or -1."""
    if kineto:
        cut = buf.rfind(KINETO_SEP, max(0, start - len(KINETO_SEP) + 1), n)
        return -1 if cut < 0 else cut + 4
    end = n
    # the last few braces only (text made of braces would cost a search per byte): a
    # boundary missed here is found among later text, the pending text growing meanwhile
    for _ in range(16):
        brace = buf.rfind(b"{", start, end)
        if brace <= 0:
            break
        # a "}, {" ending at this brace (whitespace runs over 64 bytes are not looked at)
        m = _GENERIC_CUT.search(buf, max(1, brace - 64), brace)
        if m is not None:
            return m.start(1)
        end = brace
    return -1


class _Reader:
    """One pass over a trace's text; see :func:`read_pieces`."""

    def __init__(
        self,
        on_piece: Callable[[memoryview], None],
        limits: ReadLimits,
        kineto: bool,
        lo: int,
        hi: int | None,
    ) -> None:
        self.on_piece = on_piece
        self.cap = limits.max_event_bytes
        self.max_text = limits.max_text_bytes
        self.kineto = kineto
        self.lo, self.hi = lo, hi
        self.split = lo > 0 or hi is not None
        #: one buffer, reused: ``buf[:n]`` holds text not handed on yet, ``buf[0]`` being
        #: a byte that may become a piece's ``[`` (the array's own, or the comma before
        #: the next event). It grows (in place) only for an event larger than it.
        self.buf = bytearray(4 * PIECE)
        self.n = 0
        self.base = 0  # text offset of buf[0]
        self.scanned = 0  # buf[:scanned] was searched for boundaries
        self.next_try = PIECE  # look for a boundary once this much text is pending
        self.tail_mode = False  # the events array has ended: read on to the end
        self.header: bytes | None = None

    def run(self, path: Path) -> Rest | None:
        finder = _KeyFinder()
        next_probe = 1
        for chunk in iter_text(path, self.max_text):
            self._append(chunk)
            del chunk
            if self.header is None:
                at = finder.feed(self.buf, self.n)
                if at is None:
                    if self.n >= next_probe:  # fail early on text that is no JSON object
                        self._probe_header()
                        next_probe = 2 * self.n
                    if self.n > self.cap:
                        raise _too_large(
                            "the text before the traceEvents array", self.cap, "max_event_bytes"
                        )
                    continue
                self._start(finder.key, at)
            if self.tail_mode:
                if self.n > self.cap:
                    raise _too_large(
                        "the text after the traceEvents array", self.cap, "max_event_bytes"
                    )
            elif (self.n >= self.next_try or self.n > self.cap) and not self._step():
                return None
        return self._finish()

    def _append(self, chunk: bytes) -> None:
        k, n = len(chunk), self.n
        if n + k > len(self.buf):  # grows the buffer in place (realloc, not a copy)
            self.buf[n:] = chunk
        else:
            self.buf[n : n + k] = chunk
        self.n = n + k

    def _start(self, key: int, at: int) -> None:
        """The events array starts at ``buf[at]``: keep the header (checked now, not after
        the events), drop its text."""
        buf, n = self.buf, self.n
        self.header = bytes(buf[:key]) + _HEADER_END
        try:
            _PROBE_OBJECT.decode(self.header)
        except msgspec.ValidationError as exc:
            raise _not_an_object(exc) from None
        except msgspec.DecodeError as exc:
            json_outcome(exc, 0)  # raises for malformed text
            raise TraceError(
                "not a Kineto trace (traceEvents is not a key of the document)"
            ) from None
        buf[: n - at] = buf[at:n]
        self.n, self.base, self.scanned = n - at, at, 0

    def _probe_header(self) -> None:
        view = memoryview(self.buf)[: self.n]
        try:
            _PROBE_OBJECT.decode(view)
        except msgspec.ValidationError as exc:
            raise _not_an_object(exc) from None
        except msgspec.DecodeError as exc:
            json_outcome(exc, 0)  # raises unless merely unfinished
        finally:
            view.release()

    def _step(self) -> bool:
        """Hand on the events before the last boundary in the pending text, if there is
        one; False once this reader's range is done."""
        buf, n = self.buf, self.n
        comma = _last_cut(buf, self.scanned, n, self.kineto)
        self.scanned = n
        if comma >= 0 and self.hi is not None and self.base >= self.hi:
            return False
        if comma < 0:
            outcome = self._check()
        elif self.base < self.lo:  # another process's piece
            outcome = _OK
        elif self.kineto and buf.find(b"X", 1, comma) < 0:
            # a piece without the letter X holds no complete ("X") event: nothing in it
            # is kept (profilers write memory events and flows in long runs), so it is
            # not decoded (memchr finds an X within the first events of any other piece)
            outcome = _OK
        else:
            outcome = self._decode(comma)
        if outcome == _OK:
            buf = self.buf
            buf[: n - comma] = buf[comma:n]
            self.n = n - comma
            self.base += comma
            self.scanned = self.n
            self.next_try = PIECE
            return True
        if self.split and (comma >= 0 or outcome == _TRAILING):
            # a cut was no boundary (or the array ended): the ranges would not tile
            raise Unsplittable("unconfirmed event boundaries")
        if outcome == _TRAILING:
            self.tail_mode = True
        elif n > self.cap:
            raise _too_large(
                f"one event (text without an event boundary from byte {self.base})",
                self.cap,
                "max_event_bytes",
            )
        else:
            self.next_try = 2 * n
        return True

    def _decode(self, comma: int) -> str:
        """Hand on ``buf[:comma]`` as ``[ev, ..., ev]``, decoded in place: the comma after
        its last event becomes its ``]`` meanwhile."""
        buf = self.buf
        buf[0] = 0x5B  # [
        buf[comma] = 0x5D  # ]
        view = memoryview(buf)[: comma + 1]
        try:
            self.on_piece(view)
            return _OK
        except msgspec.DecodeError as exc:
            return json_outcome(exc, self.base)
        finally:
            buf[comma] = 0x2C  # ,
            try:
                view.release()
            except BufferError:  # something still holds the piece: go on with a copy
                self.buf = bytearray(buf)

    def _check(self) -> str:
        """Check the pending text (no boundary in it) for JSON errors."""
        self.buf[0] = 0x5B
        view = memoryview(self.buf)[: self.n]
        try:
            _PROBE_ARRAY.decode(view)
            return _TRAILING  # the array is complete: the document's tail follows
        except msgspec.ValidationError:  # pragma: no cover - list[Raw] takes any array
            return _TRUNCATED
        except msgspec.DecodeError as exc:
            return json_outcome(exc, self.base)
        finally:
            view.release()

    def _finish(self) -> Rest | None:
        """At the end of the text: hand on the last events (in place), keep the tail."""
        if self.header is None:
            if self.n:
                self._probe_header()
            raise TraceError("no traceEvents array (truncated or not a Kineto trace)")
        if self.hi is not None and self.base >= self.hi:
            return None
        end = self._array_end()
        if self.base >= self.lo:  # else the last events are an earlier range's
            self._hand_on(end + 1)
        buf, n = self.buf, self.n
        tail = _TAIL_START + bytes(buf[end + 1 : n])
        self.buf = bytearray()
        return Rest(self.header, tail, self.base + end + 1 - len(_TAIL_START))

    def _array_end(self) -> int:
        """The index of the events array's closing ``]`` in the pending text."""
        buf, n = self.buf, self.n
        buf[0] = 0x5B
        view = memoryview(buf)[:n]
        try:
            _PROBE_ARRAY.decode(view)
        except msgspec.DecodeError as exc:
            if json_outcome(exc, self.base) == _TRUNCATED:  # raises for malformed text
                raise TraceError(_TRUNCATED_MSG) from None
            at = _BYTE_AT.match(str(exc))
        else:  # the text ends with the array: the document is never closed
            raise TraceError("truncated JSON: the document ends right after its events")
        finally:
            view.release()
        # text follows the array: its "]" is the last one before the position the error
        # names (msgspec's wording, not an API: so the array is decoded once more to check)
        stop = int(at.group(2)) if at and at.group(2) else n
        end = buf.rfind(b"]", 0, min(stop, n))
        view = memoryview(buf)[: end + 1]
        try:
            _PROBE_ARRAY.decode(view)
        except msgspec.DecodeError:
            raise TraceError("not valid JSON: no end of the traceEvents array found") from None
        finally:
            view.release()
        return end

    def _hand_on(self, stop: int) -> None:
        """Hand ``buf[:stop]`` (a whole array of events) to ``on_piece``."""
        view = memoryview(self.buf)[:stop]
        try:
            self.on_piece(view)
        except msgspec.DecodeError as exc:  # pragma: no cover - the array was checked
            json_outcome(exc, self.base)
            raise TraceError(_TRUNCATED_MSG) from None
        finally:
            try:
                view.release()
            except BufferError:  # something still holds the piece
                self.buf = bytearray(self.buf)


def read_pieces(
    path: Path,
    on_piece: Callable[[memoryview], None],
    limits: ReadLimits,
    kineto: bool,
    lo: int = 0,
    hi: int | None = None,
) -> Rest | None:
    """Hand the events of ``path`` to ``on_piece`` in pieces of whole events (``[ev, ...,
    ev]``, a view into the buffer, valid during the call; it decodes them and may raise
    ``msgspec.DecodeError``, which here tells a piece cut at no true boundary). Returns
    the document without its events (:class:`Rest`).

    With ``lo``/``hi`` only the pieces starting at a text offset in [lo, hi) are handed on:
    the others are cut the same way (cutting depends on the bytes alone) and dropped, so
    readers given adjacent ranges hand on every event exactly once, in file order. A range
    that ends before the text does stops early and returns None. Text whose boundaries
    need confirming raises :class:`Unsplittable` there."""
    return _Reader(on_piece, limits, kineto, lo, hi).run(path)
