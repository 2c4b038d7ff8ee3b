"""``python -m titan_core.trace analyze TRACE_DIR --out REPORT_DIR``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path


def _default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "titan", "trace")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_core.trace")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="analyze a folder of per-rank profiler traces")
    a.add_argument("trace_dir")
    a.add_argument("--out", required=True, help="report folder (summary.json, report.html)")
    a.add_argument("--config", help="YAML/JSON trace config (e.g. extra comm kernel patterns)")
    a.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    a.add_argument("--cache-dir", default=_default_cache(), help="parse cache folder")
    a.add_argument("--no-cache", action="store_true")
    a.add_argument("--pp", type=int, default=None, help="pipeline size (Megatron rank layout)")
    a.add_argument("--ray", action="store_true", help="spread parsing over a Ray cluster")
    a.add_argument("--no-report", action="store_true", help="write summary.json only")
    a.add_argument("--quiet", action="store_true")
    a.add_argument(
        "--max-trace-mb", type=int, default=None,
        help="largest trace text to read per file, after gzip, in MiB (default 8192)",
    )  # fmt: skip
    a.add_argument(
        "--max-event-mb", type=int, default=None,
        help="largest single event to hold, in MiB (default 256)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    for flag, value in (
        ("--max-trace-mb", args.max_trace_mb),
        ("--max-event-mb", args.max_event_mb),
    ):
        if value is not None and value <= 0:
            ap.error(f"{flag} must be a positive number of MiB, not {value}")

    from titan_core.trace.analyze import analyze_traces
    from titan_core.trace.categories import TraceConfig

    t0 = time.perf_counter()
    cfg = TraceConfig.from_file(args.config)
    caps = {"max_trace_bytes": args.max_trace_mb, "max_event_bytes": args.max_event_mb}
    cfg = dataclasses.replace(cfg, **{k: v << 20 for k, v in caps.items() if v is not None})
    summary, results = analyze_traces(
        args.trace_dir,
        cfg,
        workers=args.workers,
        cache_dir=None if args.no_cache else args.cache_dir,
        progress=not args.quiet,
        use_ray=args.ray,
        pp=args.pp,
        exclude=[args.out],  # the reports of earlier runs, when --out lies inside the traces
    )
    problems = summary["problems"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=_jsonable))
    if not args.no_report:
        from titan_core.trace.report import write_report

        write_report(summary, results, out / "report.html")
    for p in problems:
        print(f"skipped {p['file']}: {p['reason']}", file=sys.stderr)
    _print_summary(summary, time.perf_counter() - t0, out, report=not args.no_report)
    return 0 if results else 1


def _jsonable(x: object) -> object:
    if hasattr(x, "item"):
        return x.item()  # numpy scalars
    if isinstance(x, set):
        return sorted(x)
    raise TypeError(type(x))


def _evidence(ev: dict) -> str:
    """A slow rank's evidence (stragglers.slow_ranks) in words."""
    parts = []
    if "last_arrivals" in ev:
        parts.append(
            f"last at {ev['last_arrivals']} of {ev['collectives']} collectives "
            f"({ev['late_delay_us'] / 1e3:.2f} ms late)"
        )
    if "compute_outlier_steps" in ev:
        parts.append(
            f"compute above its peers' in {ev['compute_outlier_steps']} steps "
            f"(+{ev['compute_excess_us'] / 1e3:.2f} ms; peers' median "
            f"{ev['peer_median_compute_us'] / 1e3:.2f} ms)"
        )
    parts.append(f"clock offset {ev['clock_offset_us']:.0f} us")
    return ", ".join(parts)


def _print_summary(s: dict, secs: float, out: Path, report: bool) -> None:
    print(f"{s['num_ranks']} ranks analyzed in {secs:.1f}s; {len(s['problems'])} files skipped")
    for r in s["ranks"][:8]:
        k = r["kernel_time_us"]
        st = r["steps"]
        step = sum(x["step_time_us"] for x in st) / len(st) if st else 0
        print(
            f"  rank {r['rank']:>5}: {len(st)} steps of {step / 1e3:.1f} ms on average; kernel "
            f"time as HTA counts it: compute {k['computation'] / 1e3:.1f} ms, comm "
            f"{k['communication'] / 1e3:.1f} ms, memory {k['memory'] / 1e3:.1f} ms"
        )
    if s["num_ranks"] > 8:
        print(f"  ... {s['num_ranks'] - 8} more ranks")
    for e in s["slow_ranks"][:3]:
        print(
            f"  slow rank {e['rank']}: {e['severity_us'] / 1e3:.2f} ms; {_evidence(e['evidence'])}"
        )
    for g in s["pipeline"]["groups"][:2]:
        br = ", ".join(f"{x['bubble_ratio']}" for x in g["stages"])
        print(
            f"  pipeline {g['ranks']}: bubble ratios [{br}] theory {g['theoretical_bubble_ratio']}"
        )
    print(f"wrote {out / 'summary.json'}" + (f" and {out / 'report.html'}" if report else ""))
