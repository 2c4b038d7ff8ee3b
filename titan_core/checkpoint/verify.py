"""Cheap checks that a saved iteration can be loaded, run before anything is built.

A ``torch_dist`` iteration folder holds ``metadata.json`` (the backends), ``.metadata``
(torch.distributed.checkpoint's index: for every saved item, its shard file, offset and
length), the shard files ``__R_N.distcp`` and ``common.pt`` (Megatron-LM's ``args`` and
iteration; Titan's step, scheduler, data position). What can be known without loading a
tensor is checked: every file the index names is there and long enough, and ``common.pt``
reads with ``weights_only=True`` (``megatron_lm.read_common``). A shard
whose bytes are damaged at the right length is only found by the load itself, which then
fails with :class:`CheckpointError` naming the iteration (see ``dist.load_checkpoint``).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from titan_core.checkpoint.megatron_lm import read_common


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the iteration and the file."""


def describe(e: BaseException) -> str:
    """One line on what went wrong, never torch's advice to retry with ``weights_only=False``
    (which would run whatever code a damaged or foreign file holds)."""
    text = str(e).strip()
    if "weights_only" in text:
        reason = text.rsplit("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        detail = reason[0] if "WeightsUnpickler error:" in text and reason else "unknown content"
        return f"not a file Titan wrote; the safe loader refused it ({detail[:200]})"
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first}"[:300]


def damage(folder: str | Path) -> str | None:
    """Why the iteration in ``folder`` cannot be loaded (naming the file), or None if the
    checks pass."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} is missing"
    meta_json = folder / "metadata.json"
    try:
        backend = json.loads(meta_json.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        return f"{meta_json} is unreadable ({describe(e)})"
    if backend != "torch_dist":
        return f"{meta_json} names the sharded backend {backend!r}; Titan writes torch_dist"
    index = folder / ".metadata"
    try:
        with index.open("rb") as f:
            storage = pickle.load(f).storage_data  # as torch.distributed.checkpoint reads it
    except Exception as e:  # truncated or foreign bytes: any unpickling error
        return f"{index} is unreadable ({describe(e)})"
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(need.items()):
        shard = folder / name
        if not shard.is_file():
            return f"{shard} is missing (the index {index.name} names it)"
        size = shard.stat().st_size
        if size < end:
            return f"{shard} is truncated: {size} bytes, the index needs {end}"
    common = folder / "common.pt"
    try:
        read_common(common)
    except Exception as e:
        return f"{common} is unreadable ({describe(e)})"
    return None
