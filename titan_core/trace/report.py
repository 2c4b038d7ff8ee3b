"""Self-contained ``report.html``: tables plus matplotlib pictures embedded as base64 PNGs."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import numpy as np

from titan_core.trace.breakdown import RankResult


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _figures(s: dict[str, Any], results: list[RankResult]) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    ranks = s["ranks"][:64]
    if ranks:
        fig, ax = plt.subplots(figsize=(10, 3.5))
        x = np.arange(len(ranks))
        bottom = np.zeros(len(ranks))
        for key, label in (
            ("computation_us", "computation"),
            ("communication_exposed_us", "communication (exposed)"),
            ("memory_exposed_us", "memory (exposed)"),
            ("idle_us", "idle"),
        ):
            v = np.array([sum(st[key] for st in r["steps"]) / 1e3 for r in ranks])
            ax.bar(x, v, bottom=bottom, label=label)
            bottom += v
        ax.set_xticks(x, [str(r["rank"]) for r in ranks], fontsize=7)
        ax.set_xlabel("rank")
        ax.set_ylabel("ms (all steps)")
        ax.legend(fontsize=7)
        figs.append(("Time breakdown per rank", _png(fig)))
    groups = s["pipeline"]["groups"]
    by_rank = {r.rank: r for r in results}
    if groups:
        g = groups[0]
        step = g["steps"][-1] if g["steps"] else None
        if step is not None:
            lo, hi = g["step_windows"][str(step)]
            fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(g["ranks"])))
            for si, rank in enumerate(g["ranks"]):
                r = by_rank.get(rank)
                if r is None:
                    continue
                cs, ce = (np.asarray(x, dtype=np.int64) for x in r.compute_coarse)
                m = (ce > lo) & (cs < hi)
                ax.broken_barh(
                    [((a - lo) / 1e3, (b - a) / 1e3) for a, b in zip(cs[m], ce[m], strict=True)],
                    (si - 0.4, 0.8),
                    color="tab:blue",
                )
                ax.broken_barh([(0, (hi - lo) / 1e3)], (si - 0.4, 0.8), color="tab:red", alpha=0.15)
                for op in r.comm_ops:
                    if op.step == step and op.p2p:
                        ax.broken_barh(
                            [((op.ts - lo) / 1e3, max(op.dur, 1) / 1e3)],
                            (si - 0.4, 0.25),
                            color="tab:green",
                        )
            ax.set_yticks(
                range(len(g["ranks"])), [f"stage {i} (rank {r})" for i, r in enumerate(g["ranks"])]
            )
            ax.invert_yaxis()
            ax.set_xlabel(f"ms since step {step} start (blue compute, red bubble, green P2P)")
            figs.append((f"Pipeline group {g['ranks'][:8]} timeline, step {step}", _png(fig)))
    steps = sorted({st["step"] for r in ranks for st in r["steps"]})
    if ranks and steps:
        mat = np.full((len(ranks), len(steps)), np.nan)
        for i, r in enumerate(ranks):
            for st in r["steps"]:
                mat[i, steps.index(st["step"])] = st["step_time_us"] / 1e3
        fig, ax = plt.subplots(figsize=(6, 0.5 + 0.12 * len(ranks) + 1))
        im = ax.imshow(mat, aspect="auto", cmap="viridis")
        fig.colorbar(im, ax=ax, label="step time (ms)")
        ax.set_xticks(range(len(steps)), [str(x) for x in steps], fontsize=7)
        ax.set_yticks(range(len(ranks)), [str(r["rank"]) for r in ranks], fontsize=6)
        ax.set_xlabel("step")
        ax.set_ylabel("rank")
        figs.append(("Step time, rank x step", _png(fig)))
    if s["top_kernels"]:
        top = s["top_kernels"][:15][::-1]
        fig, ax = plt.subplots(figsize=(10, 0.4 * len(top) + 1))
        colors = {"computation": "tab:blue", "communication": "tab:orange", "memory": "tab:green"}
        ax.barh(
            [k["name"][:70] for k in top],
            [k["sum_us"] / 1e3 for k in top],
            color=[colors.get(k["kind"], "gray") for k in top],
        )
        ax.tick_params(axis="y", labelsize=6)
        ax.set_xlabel("total ms (all ranks)")
        figs.append(("Top kernels", _png(fig)))
    comm = [c for c in s["communication"] if c["median_busbw_GBps"]][:12]
    if comm:
        fig, ax = plt.subplots(figsize=(10, 3))
        ax.bar(
            [f"{c['collective']}\n{c['process_group'][:18]}" for c in comm],
            [c["median_busbw_GBps"] for c in comm],
        )
        ax.tick_params(axis="x", labelsize=6)
        ax.set_ylabel("median bus bandwidth (GB/s)")
        figs.append(("Communication bandwidth by collective", _png(fig)))
    return figs


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(summary: dict[str, Any], results: list[RankResult], path: str | Path) -> None:
    """Write the HTML report (no external files or scripts)."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Titan trace report</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}</style></head><body>",
        f"<h1>Titan trace analysis: {summary['num_ranks']} ranks</h1>",
    ]
    if summary["problems"]:
        parts.append("<h2>Skipped files</h2>" + _table(summary["problems"], ["file", "reason"]))
    for title, src in _figures(summary, results):
        parts.append(f"<h2>{html.escape(title)}</h2><img src='{src}'>")
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
    Path(path).write_text("\n".join(parts))
