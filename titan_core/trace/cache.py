"""The parse cache: a parsed file (:class:`~titan_core.trace.columns.RankTrace`) kept as
msgpack on disk, keyed by the file's path, mtime and size and by the trace config, so
analyzing the same files again skips their parsing. A damaged entry is parsed again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

from titan_core.trace.categories import TraceConfig
from titan_core.trace.columns import Events, RankTrace
from titan_core.trace.parse import parse_file

#: bump when the parsed columns change, so entries written before are not read
CACHE_VERSION = "7"


_CACHE_ENC = msgspec.msgpack.Encoder()
_CACHE_DEC = msgspec.msgpack.Decoder()


def cache_key(path: str | Path) -> str:
    """The key of ``path``'s current contents (path, mtime and size; the config is added
    by :func:`load_cached`)."""
    import hashlib  # here: a run without the cache does not pay its import

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
