"""Parse one Kineto trace file into a columnar frame, keeping only what the analyses use.

msgspec decodes the JSON straight into typed structs that name only the needed fields, so
the rest of each event (most of ``args``: shapes, concrete inputs, occupancy...) is skipped
instead of becoming Python objects; the events then become one polars frame per rank.
Timestamps follow HTA's convention (start rounded up, end rounded down to whole
microseconds) so interval sums agree with it. A parse cache (parquet + metadata, keyed by
path, mtime and size) makes re-analysis of the same files cheap.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import orjson
import polars as pl

from titan_core.trace.categories import TraceConfig

CACHE_VERSION = "1"


class TraceError(Exception):
    """A trace file that cannot be analyzed; the message says why."""


class _Args(msgspec.Struct, frozen=True):
    external_id: int | float | str | None = msgspec.field(default=None, name="External id")
    correlation: int | float | str | None = None
    stream: int | float | str | None = None
    collective: str | None = msgspec.field(default=None, name="Collective name")
    in_nelems: int | float | str | None = msgspec.field(default=None, name="In msg nelems")
    out_nelems: int | float | str | None = msgspec.field(default=None, name="Out msg nelems")
    group_size: int | float | str | None = msgspec.field(default=None, name="Group size")
    dtype: str | None = None
    pg_name: str | int | None = msgspec.field(default=None, name="Process Group Name")
    pg_desc: str | None = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Process Group Ranks")
    seq: int | float | str | None = msgspec.field(default=None, name="Seq")
    input_dims: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input type")


class _Event(msgspec.Struct, frozen=True):
    ph: str | None = None
    cat: str | None = None
    name: str | None = None
    tid: int | float | str | None = None
    ts: float | str | None = None
    dur: float | str | None = None
    args: _Args | None = None


class _File(msgspec.Struct):
    traceEvents: list[_Event] = []  # noqa: N815 (the file's key)
    distributedInfo: dict[str, Any] | None = None  # noqa: N815
    deviceProperties: list[Any] | None = None  # noqa: N815


_DECODER = msgspec.json.Decoder(_File)

SCHEMA: dict[str, Any] = {
    "ts": pl.Int64,
    "end": pl.Int64,
    "cat": pl.Categorical,
    "name": pl.Categorical,
    "tid": pl.Categorical,
    "stream": pl.Int64,
    "corr": pl.Int64,
    "ext": pl.Int64,
    "coll": pl.String,
    "in_n": pl.Int64,
    "out_n": pl.Int64,
    "gsize": pl.Int64,
    "dtype": pl.String,
    "pg_name": pl.String,
    "pg_desc": pl.String,
    "pg_ranks": pl.String,
    "seq": pl.Int64,
    "in_dims": pl.String,
    "in_type": pl.String,
}


@dataclass
class RankTrace:
    """One parsed file: its rank (None if the file carries none), metadata and events."""

    path: str
    rank: int | None
    meta: dict[str, Any]
    events: pl.DataFrame
    cpu_ops: pl.DataFrame
    warnings: list[str] = field(default_factory=list)


_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.I)


def find_trace_files(trace_dir: str | Path) -> list[Path]:
    """All ``*.json`` / ``*.json.gz`` files below ``trace_dir`` (sorted)."""
    root = Path(trace_dir)
    if root.is_file():
        return [root]
    files = [p for p in root.rglob("*") if p.is_file() and p.name.endswith((".json", ".json.gz"))]
    return sorted(files)


def _int(v: Any, default: int | None = -1) -> int | None:
    if v is None:
        return default
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".gz") or data[:2] == b"\x1f\x8b":
        # the gzip footer holds the uncompressed size (mod 4 GiB): decompress into one
        # buffer of that size instead of growing (and copying) it
        size_hint = int.from_bytes(data[-4:], "little") if len(data) >= 18 else 0
        try:
            d = zlib.decompressobj(wbits=31)
            out = d.decompress(data, 0) if size_hint == 0 else d.decompress(data)
            if not d.eof:
                raise TraceError("truncated gzip stream")
        except zlib.error as exc:
            raise TraceError(f"corrupt gzip: {exc}") from exc
        return out
    return data


def _rows_from_structs(
    events: list[_Event], cfg: TraceConfig
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Columns of the interesting events, and (ts, end, tid) of the plain CPU ops (only
    needed as the compute stream of CPU-only traces, so kept in a compact frame)."""
    cols: dict[str, list[Any]] = {k: [] for k in SCHEMA}
    ops: dict[str, list[Any]] = {"ts": [], "end": [], "tid": []}
    ops_ts, ops_end, ops_tid = ops["ts"], ops["end"], ops["tid"]
    ts_l, end_l, cat_l, name_l, tid_l = (
        cols["ts"],
        cols["end"],
        cols["cat"],
        cols["name"],
        cols["tid"],
    )
    stream_l, corr_l, ext_l = cols["stream"], cols["corr"], cols["ext"]
    comm_cols = ("coll", "in_n", "out_n", "gsize", "dtype", "pg_name", "pg_desc", "pg_ranks", "seq")
    comm_lists = [cols[c] for c in comm_cols]
    dims_l, type_l = cols["in_dims"], cols["in_type"]
    gpu_cats = set(cfg.gpu_event_cats)
    is_cpu_comm = cfg.is_cpu_comm
    ceil, floor = math.ceil, math.floor
    for ev in events:
        if ev.ph != "X" or ev.cat is None or ev.cat == "Trace" or ev.dur is None:
            continue
        try:
            ts = float(ev.ts)  # type: ignore[arg-type]
            dur = float(ev.dur)
        except (TypeError, ValueError):
            continue
        cat = ev.cat
        name = ev.name or ""
        if cat == "cpu_op" and not is_cpu_comm(name):
            ops_ts.append(ceil(ts))
            ops_end.append(floor(ts + dur))
            ops_tid.append(str(ev.tid))
            continue
        ts_l.append(ceil(ts))
        end_l.append(floor(ts + dur))
        cat_l.append(cat)
        name_l.append(name)
        tid_l.append(str(ev.tid))
        a = ev.args
        if a is None:
            stream_l.append(-1)
            corr_l.append(-1)
            ext_l.append(-1)
            for c in comm_lists:
                c.append(None)
            dims_l.append(None)
            type_l.append(None)
            continue
        stream_l.append(_int(a.stream))
        corr_l.append(_int(a.correlation))
        ext_l.append(_int(a.external_id))
        if a.collective is not None or a.pg_name is not None:
            vals = (
                a.collective,
                _int(a.in_nelems, None),
                _int(a.out_nelems, None),
                _int(a.group_size, None),
                a.dtype,
                None if a.pg_name is None else str(a.pg_name),
                a.pg_desc,
                bytes(a.pg_ranks).decode() or None,
                _int(a.seq, None),
            )
            for c, v in zip(comm_lists, vals, strict=True):
                c.append(v)
        else:
            for c in comm_lists:
                c.append(None)
        if (cat in gpu_cats or is_cpu_comm(name)) and len(a.input_dims):
            dims_l.append(bytes(a.input_dims).decode())
            type_l.append(bytes(a.input_type).decode() or None)
        else:
            dims_l.append(None)
            type_l.append(None)
    return cols, ops


def _rows_from_dicts(
    events: list[dict[str, Any]], cfg: TraceConfig
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Slow path for files whose field types the typed decoder rejects."""

    def raw(v: Any) -> msgspec.Raw:
        return msgspec.Raw() if v is None else msgspec.Raw(orjson.dumps(v))

    structs = []
    for e in events:
        if not isinstance(e, dict):
            continue
        a = e.get("args")
        args = None
        if isinstance(a, dict):
            pg = a.get("Process Group Name")
            args = _Args(
                external_id=a.get("External id"),
                correlation=a.get("correlation"),
                stream=a.get("stream") if isinstance(a.get("stream"), (int, float, str)) else None,
                collective=str(a["Collective name"]) if "Collective name" in a else None,
                in_nelems=a.get("In msg nelems"),
                out_nelems=a.get("Out msg nelems"),
                group_size=a.get("Group size"),
                dtype=str(a["dtype"]) if "dtype" in a else None,
                pg_name=None if pg is None else str(pg),
                pg_desc=a.get("Process Group Description"),
                pg_ranks=raw(a.get("Process Group Ranks")),
                seq=a.get("Seq"),
                input_dims=raw(a.get("Input Dims")),
                input_type=raw(a.get("Input type")),
            )
        structs.append(
            _Event(
                ph=e.get("ph"),
                cat=e.get("cat"),
                name=str(e.get("name", "")),
                tid=e.get("tid") if isinstance(e.get("tid"), (int, float, str)) else None,
                ts=e.get("ts"),
                dur=e.get("dur"),
                args=args,
            )
        )
    return _rows_from_structs(structs, cfg)


_SEP = b"\n  },\n  {"
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_ARRAY_END = re.compile(rb"\n  \}\s*\]|^\s*\]")
_PIECE_DECODER = msgspec.json.Decoder(list[_Event])
_CHUNK = 2 << 20


def _iter_plain(path: Path) -> Any:
    """Yield the decompressed bytes of a trace in chunks of a few MB."""
    with open(path, "rb") as fh:
        head = fh.read(2)
        fh.seek(0)
        if head == b"\x1f\x8b":
            d = zlib.decompressobj(wbits=31)
            while True:
                comp = fh.read(_CHUNK // 4)
                if not comp:
                    break
                try:
                    out = d.decompress(comp, _CHUNK)
                    while out:
                        yield out
                        tail = d.unconsumed_tail
                        out = d.decompress(tail, _CHUNK) if tail else b""
                except zlib.error as exc:
                    raise TraceError(f"corrupt gzip: {exc}") from exc
            if not d.eof:
                raise TraceError("truncated gzip stream")
        else:
            while chunk := fh.read(_CHUNK):
                yield chunk


OPS_SCHEMA: dict[str, Any] = {"ts": pl.Int64, "end": pl.Int64, "tid": pl.Categorical}


def _frame(cols: dict[str, list[Any]]) -> pl.DataFrame:
    return pl.DataFrame(cols, schema=SCHEMA)


def _frames(
    both: tuple[dict[str, list[Any]], dict[str, list[Any]]],
) -> tuple[pl.DataFrame, pl.DataFrame]:
    return pl.DataFrame(both[0], schema=SCHEMA), pl.DataFrame(both[1], schema=OPS_SCHEMA)


def _stream_events(
    path: Path, cfg: TraceConfig
) -> tuple[bytes, list[tuple[pl.DataFrame, pl.DataFrame]]]:
    """Decode a Kineto-formatted trace piece by piece (events are split at their
    top-level boundaries), so only a few MB of JSON text and Python objects are alive at
    a time. Returns the document without its events, and the event frames."""
    buf = bytearray()
    header: bytes | None = None
    frames: list[tuple[pl.DataFrame, pl.DataFrame]] = []
    for chunk in _iter_plain(path):
        buf += chunk
        if header is None:
            m = _EVENTS_KEY.search(buf)
            if m is None:
                continue
            header = bytes(buf[: m.start()]) + b'"traceEvents": '
            del buf[: m.end()]
        if len(buf) < _CHUNK:
            continue
        cut = buf.rfind(_SEP)
        if cut < 0:
            continue
        piece = b"[" + buf[: cut + 4] + b"]"
        del buf[: cut + 5]
        frames.append(_frames(_rows_from_structs(_PIECE_DECODER.decode(piece), cfg)))
        del piece
    if header is None:
        raise TraceError("no traceEvents array (truncated or not a Kineto trace)")
    # the rest: the last events, the array's end and the document's tail
    last = buf.rfind(_SEP)
    m = _ARRAY_END.search(buf, 0 if last < 0 else last)
    if m is None:
        raise TraceError("truncated JSON: the traceEvents array never ends")
    tail_start = m.end()
    body_end = m.start() + (4 if buf[m.start() : m.start() + 1] == b"\n" else 0)
    piece = b"[" + buf[:body_end] + b"]"
    frames.append(_frames(_rows_from_structs(_PIECE_DECODER.decode(piece), cfg)))
    doc = header + b"[]" + bytes(buf[tail_start:])
    return doc, frames


def parse_file(path: str | Path, cfg: TraceConfig | None = None) -> RankTrace:
    """Parse one trace file; raises :class:`TraceError` naming what is wrong with it."""
    cfg = cfg or TraceConfig()
    p = Path(path)
    warnings: list[str] = []
    try:
        doc_bytes, frames = _stream_events(p, cfg)
        doc = _DECODER.decode(doc_bytes)
        dist = doc.distributedInfo or {}
        device_props = doc.deviceProperties or []
        events = pl.concat([f[0] for f in frames], rechunk=False)
        cpu_ops = pl.concat([f[1] for f in frames], rechunk=False)
        del frames
    except (msgspec.DecodeError, msgspec.ValidationError, TraceError) as first:
        # not in Kineto's layout, odd field types, or really broken: whole-file slow path
        try:
            data = _read_bytes(p)
            raw_doc = orjson.loads(data)
        except TraceError:
            raise
        except orjson.JSONDecodeError as exc:
            raise TraceError(f"corrupt or truncated JSON: {exc}") from exc
        del data
        if not isinstance(raw_doc, dict) or not isinstance(raw_doc.get("traceEvents"), list):
            raise TraceError(f"not a Kineto trace ({first})") from None
        dist = raw_doc.get("distributedInfo") or {}
        device_props = raw_doc.get("deviceProperties") or []
        events, cpu_ops = _frames(_rows_from_dicts(raw_doc["traceEvents"], cfg))
        del raw_doc
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
    return RankTrace(str(p), rank, meta, events, cpu_ops, warnings)


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


def _device_kind(device_props: list[Any], events: pl.DataFrame) -> str:
    names = " ".join(str(d.get("name", "")) for d in device_props if isinstance(d, dict)).lower()
    if any(k in names for k in ("mi2", "mi3", "amd", "radeon", "instinct")):
        return "rocm"
    if "mtia" in names:
        return "mtia"
    if events.filter(pl.col("stream") >= 0).height == 0:
        return "cpu"
    return "gpu"


# ----------------------------------------------------------------------------- cache


def cache_key(path: str | Path) -> str:
    p = Path(path).resolve()
    st = p.stat()
    key = f"{CACHE_VERSION}|{p}|{st.st_mtime_ns}|{st.st_size}"
    return hashlib.sha1(key.encode()).hexdigest()


def load_cached(
    path: str | Path, cfg: TraceConfig | None = None, cache_dir: str | Path | None = None
) -> RankTrace:
    """:func:`parse_file` through the parse cache (when ``cache_dir`` is given)."""
    if cache_dir is None:
        return parse_file(path, cfg)
    cfg_key = hashlib.sha1(json.dumps(cfg.to_dict() if cfg else {}, sort_keys=True).encode())
    key = cache_key(path) + cfg_key.hexdigest()[:8]
    d = Path(cache_dir)
    pq, po, mj = d / f"{key}.parquet", d / f"{key}.ops.parquet", d / f"{key}.json"
    if pq.exists() and mj.exists() and po.exists():
        try:
            info = json.loads(mj.read_text())
            return RankTrace(
                info["path"],
                info["rank"],
                info["meta"],
                pl.read_parquet(pq),
                pl.read_parquet(po),
                info["warnings"],
            )
        except Exception:  # a damaged cache entry is just re-parsed
            pass
    rt = parse_file(path, cfg)
    d.mkdir(parents=True, exist_ok=True)
    for frame, target in ((rt.events, pq), (rt.cpu_ops, po)):
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        frame.write_parquet(tmp, compression="lz4")
        os.replace(tmp, target)
    mj.write_text(
        json.dumps({"path": rt.path, "rank": rt.rank, "meta": rt.meta, "warnings": rt.warnings})
    )
    return rt
