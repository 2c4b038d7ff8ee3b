"""Self-contained ``report.html``: tables, and pictures as SVG written into the page.

The pictures are drawn by :mod:`titan_core.trace.svg` (text, no plotting library), so the
report costs milliseconds and opens anywhere without network access.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from titan_core.trace import svg
from titan_core.trace.breakdown import RankResult

#: the four parts of a step, as the breakdown figure stacks them
_BREAKDOWN = (
    ("computation_us", "computation", svg.BLUE),
    ("communication_exposed_us", "communication (exposed)", svg.ORANGE),
    ("memory_exposed_us", "memory (exposed)", svg.GREEN),
    ("idle_us", "idle", svg.RED),
)
_KIND_COLORS = {"computation": svg.BLUE, "communication": svg.ORANGE, "memory": svg.GREEN}


def _breakdown(ranks: list[dict[str, Any]]) -> str:
    series = [
        svg.Series(label, color, [sum(st[key] for st in r["steps"]) / 1e3 for r in ranks])
        for key, label, color in _BREAKDOWN
    ]
    return svg.columns(
        [str(r["rank"]) for r in ranks],
        series,
        title="Time breakdown per rank",
        x_label="rank",
        y_label="ms (all steps)",
    )


def _pipeline(
    g: dict[str, Any], step: int, by_rank: dict[int, RankResult], offsets: dict[str, float]
) -> str:
    """One lane per stage over the group's step window: compute, bubble, P2P. The window
    is on the common clock, so each rank's events are moved by its clock offset."""
    w_lo, w_hi = g["step_windows"][str(step)]
    lanes: list[list[svg.Mark]] = []
    for rank in g["ranks"]:
        o = round(offsets.get(str(rank), 0.0))
        lo, hi = w_lo + o, w_hi + o  # the window on this rank's clock
        marks = [svg.Mark(0.0, (hi - lo) / 1e3, svg.RED, "bubble (window)", opacity=0.15)]
        r = by_rank.get(rank)
        if r is not None:
            cs, ce = r.compute_coarse
            marks += [
                svg.Mark((max(a, lo) - lo) / 1e3, (min(b, hi) - lo) / 1e3, svg.BLUE, "compute")
                for a, b in zip(cs, ce, strict=True)
                if b > lo and a < hi
            ]
            marks += [
                svg.Mark(
                    (op.ts - lo) / 1e3,
                    (op.ts + max(op.dur, 1) - lo) / 1e3,
                    svg.GREEN,
                    f"P2P {op.collective}",
                    height=0.3,
                )
                for op in r.comm_ops
                if op.step == step and op.p2p
            ]
        lanes.append(marks)
    return svg.lanes(
        [f"stage {i} (rank {r})" for i, r in enumerate(g["ranks"])],
        lanes,
        (w_hi - w_lo) / 1e3,
        title=f"Pipeline group timeline, step {step}",
        x_label=f"ms since step {step} start",
        unit="ms",
        legend=[("compute", svg.BLUE), ("bubble", "#f6d5d5"), ("P2P", svg.GREEN)],
    )


def _step_heatmap(ranks: list[dict[str, Any]], steps: list[int]) -> str:
    col = {s: j for j, s in enumerate(steps)}
    mat: list[list[float | None]] = []
    for r in ranks:
        line: list[float | None] = [None] * len(steps)
        for st in r["steps"]:
            line[col[st["step"]]] = st["step_time_us"] / 1e3
        mat.append(line)
    return svg.heatmap(
        [str(r["rank"]) for r in ranks],
        [str(s) for s in steps],
        mat,
        title="Step time, rank x step",
        x_label="step",
        y_label="rank",
        value_label="step time (ms)",
    )


def _figures(s: dict[str, Any], results: list[RankResult]) -> list[tuple[str, str]]:
    """(title, inline SVG) of each picture the summary has data for."""
    figs = []
    ranks = s["ranks"][:64]
    if ranks:
        figs.append(("Time breakdown per rank", _breakdown(ranks)))
    groups = s["pipeline"]["groups"]
    if groups and groups[0]["steps"]:
        g, step = groups[0], groups[0]["steps"][-1]
        by_rank = {r.rank: r for r in results}
        figs.append(
            (
                f"Pipeline group {g['ranks'][:8]} timeline, step {step}",
                _pipeline(g, step, by_rank, s.get("clock_offsets_us", {})),
            )
        )
    steps = sorted({st["step"] for r in ranks for st in r["steps"]})
    if ranks and steps:
        figs.append(("Step time, rank x step", _step_heatmap(ranks, steps)))
    if s["top_kernels"]:
        top = s["top_kernels"][:15]
        figs.append(
            (
                "Top kernels",
                svg.hbars(
                    [k["name"] for k in top],
                    [k["sum_us"] / 1e3 for k in top],
                    [_KIND_COLORS.get(k["kind"], svg.GRAY) for k in top],
                    title="Top kernels",
                    x_label="total ms (all ranks)",
                    legend=list(_KIND_COLORS.items()),
                ),
            )
        )
    comm = [c for c in s["communication"] if c["median_busbw_GBps"]][:12]
    if comm:
        figs.append(
            (
                "Communication bandwidth by collective",
                svg.hbars(
                    [f"{c['collective']} {c['process_group']}" for c in comm],
                    [c["median_busbw_GBps"] for c in comm],
                    [svg.BLUE] * len(comm),
                    title="Communication bandwidth by collective",
                    x_label="median bus bandwidth (GB/s)",
                    label_chars=40,
                ),
            )
        )
    return figs


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _num(key: str) -> int:
    """``layer12`` -> 12: layers in order."""
    digits = "".join(c for c in key if c.isdigit())
    return int(digits) if digits else -1


def write_report(summary: dict[str, Any], results: list[RankResult], path: str | Path) -> None:
    """Write the HTML report: one file, no scripts, nothing fetched."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Titan trace report</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px}svg{max-width:100%;height:auto}"
        "</style></head><body>",
        f"<h1>Titan trace analysis: {summary['num_ranks']} ranks</h1>",
    ]
    if summary["problems"]:
        parts.append("<h2>Skipped files</h2>" + _table(summary["problems"], ["file", "reason"]))
    for title, picture in _figures(summary, results):
        parts.append(f"<h2>{html.escape(title)}</h2>{picture}")
    parts.append("<h2>Slow ranks</h2>")
    parts.append(
        _table(
            [{**e, **e["evidence"]} for e in summary["slow_ranks"][:20]],
            [
                "rank",
                "severity_us",
                "last_arrivals",
                "late_delay_us",
                "compute_outlier_steps",
                "compute_excess_us",
            ],
        )
    )
    for g in summary["pipeline"]["groups"][:4]:
        parts.append(f"<h2>Pipeline group {html.escape(str(g['ranks']))}</h2>")
        parts.append(
            f"<p>microbatches {g['num_microbatches']}, virtual stages {g['virtual_stages']}, theoretical bubble {g['theoretical_bubble_ratio']}</p>"
        )
        parts.append(
            _table(g["stages"], ["stage", "rank", "bubble_ratio", "bubble_us", "compute_us"])
        )
    for st in summary["critical_path"]["steps"]:
        cp = st["critical_path"]
        parts.append(
            f"<h2>Critical path, step {st['step']}</h2><p>observed {st['observed_us']} us, replayed {st['replayed_us']} us; by kind {cp['time_by_kind_us']}</p>"
        )
        parts.append(_table(st["what_if"], ["rank", "speedup_of_rank", "step_us", "saved_us"]))
    parts.append(
        "<h2>Communication</h2>"
        + _table(
            summary["communication"][:30],
            [
                "collective",
                "process_group",
                "algorithms",
                "count",
                "time_us",
                "median_msg_bytes",
                "median_busbw_GBps",
            ],
        )
    )
    if summary.get("moe_load"):  # from the run's metrics.jsonl, not from the traces
        rows = summary["moe_load"]
        cols = ["step", "max", *sorted({k for r in rows for k in r} - {"step", "max"}, key=_num)]
        parts.append(
            "<h2>MoE expert load (tokens per expert max/mean, from metrics.jsonl)</h2>"
            + _table(rows, cols)
        )
    parts.append(
        "<h2>Ranks</h2>"
        + _table(
            [
                {"rank": r["rank"], **r["kernel_time_us"], "steps": len(r["steps"])}
                for r in summary["ranks"][:256]
            ],
            ["rank", "computation", "communication", "memory", "steps"],
        )
    )
    parts.append("</body></html>")
    Path(path).write_text("\n".join(parts), encoding="utf-8")
