"""``metrics.jsonl`` (one JSON object per step) and the one-line progress status."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import orjson


class MetricsWriter:
    """Append-only JSON-lines metrics; line-buffered so a kill loses at most one step."""

    def __init__(
        self, path: str | Path, enabled: bool = True, truncate_after: int | None = None
    ) -> None:
        """``truncate_after``: a resumed run's last completed step; records of later steps
        (written before the run stopped, and about to be run again) are dropped first."""
        self.path = Path(path)
        self.enabled = enabled
        self._f = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if truncate_after is not None and self.path.is_file():
                kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= truncate_after]
                tmp = self.path.with_suffix(".jsonl.tmp")
                tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in kept))
                tmp.replace(self.path)
            self._f = open(self.path, "ab")  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self._f.write(orjson.dumps(clean) + b"\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (a torn last line is skipped)."""
    out = []
    for line in Path(path).read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return out


def drop_records_after(path: str | Path, step: int) -> int:
    """Drop the records of ``path`` with a ``step`` above ``step`` (and a torn last line);
    returns how many were dropped. A run resumed from the checkpoint of ``step`` calls this
    before appending, so the steps it repeats are recorded once. The file is replaced
    atomically; a missing file is fine."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_bytes().splitlines()
    kept = []
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(record, dict) or record.get("step", step) <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def format_status(record: dict[str, Any], total: int) -> str:
    """``step  12/200 | loss 1.2345 | lr 1.00e-03 | 12,345 tok/s | 0.41 s/step``."""
    parts = [f"step {record['step']:>5}/{total}", f"loss {record['loss']:.4f}"]
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    if "grad_norm" in record and record["grad_norm"] is not None:
        parts.append(f"grad {record['grad_norm']:.3f}")
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if "step_time_s" in record:
        parts.append(f"{record['step_time_s']:.2f} s/step")
    if "eval/loss" in record:
        parts.append(f"eval loss {record['eval/loss']:.4f}")
    if "eval/accuracy" in record:
        parts.append(f"eval acc {record['eval/accuracy']:.3f}")
    return " | ".join(parts)
