"""MoE expert load beside a Titan run's traces.

The profiler traces hold no routing; the pretraining loop writes tokens per expert max/mean
per MoE layer (``moe/load_imbalance_layer{i}``, ``moe/load_imbalance_max``) to the run's
``metrics.jsonl``. Titan writes traces to ``run.dir/traces`` by default, so the metrics sit
in the trace directory's parent (or in the trace directory itself); the report shows those
of the traced steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

PREFIX = "moe/load_imbalance_"


def _metrics_file(trace_dir: Path) -> Path | None:
    for folder in (trace_dir, trace_dir.parent):
        if (folder / "metrics.jsonl").is_file():
            return folder / "metrics.jsonl"
    return None


def moe_load_rows(trace_dir: str | Path, steps: set[int] | None = None) -> list[dict[str, Any]]:
    """One row per step of ``steps`` (all, if None) with MoE load figures: ``step``, ``max``
    and ``layer{i}`` (max/mean tokens per expert); empty when the run logged none."""
    path = _metrics_file(Path(trace_dir))
    if path is None:
        return []
    rows = []
    for line in path.read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn last line
        if not isinstance(record, dict) or f"{PREFIX}max" not in record:
            continue
        if steps is not None and record.get("step") not in steps:
            continue
        row: dict[str, Any] = {"step": record.get("step")}
        for key, value in record.items():
            if key.startswith(PREFIX):
                row[key[len(PREFIX) :]] = round(value, 3) if value is not None else None
        rows.append(row)
    return rows
