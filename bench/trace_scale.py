"""Scale bench: a generated 1,024-rank pipeline job analyzed end to end.

Prints generation size, analysis wall time on this machine, and the projected time for
10,000 ranks on a 64-core node (per-rank cost scales linearly over the cores; the
cross-rank part is measured separately and scaled linearly with the rank count).
Goal: 1,024 ranks in under 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from titan_core.trace.analyze import build_summary, load_ranks
from titan_core.trace.synth import write_job


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the worker pool)."""
    u = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(x.ru_utime + x.ru_stime for x in u)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--filler", type=int, default=60, help="kernels per microbatch phase")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    d = Path(args.dir or tempfile.mkdtemp(prefix="titan_trace_scale_"))
    ranks = args.pp * args.dp
    t = time.perf_counter()
    write_job(
        d,
        pp=args.pp,
        dp=args.dp,
        m=args.microbatches,
        steps=args.steps,
        t_fwd=2000.0,
        slow={ranks // 2 + 1: 1.25},
        filler=args.filler,
    )
    gen = time.perf_counter() - t
    size = sum(p.stat().st_size for p in d.iterdir())
    c0 = _cpu()
    t0 = time.perf_counter()
    results, problems = load_ranks(d, workers=args.workers, progress=True)
    t1 = time.perf_counter()
    c1 = _cpu()
    summary = build_summary(results, problems)
    t2 = time.perf_counter()
    events = sum(r.n_events for r in results)
    cores = args.workers or 1
    per_rank_core_s = (t1 - t0) * cores / ranks
    proj = per_rank_core_s * 10_000 / 64 + (t2 - t1) * 10_000 / ranks
    print(
        f"generated {ranks} ranks, {events / ranks:.0f} events/rank, {size / 1e6:.0f} MB gz in {gen:.0f}s"
    )
    print(f"parse+per-rank: {t1 - t0:.1f}s on {cores} cores; cross-rank: {t2 - t1:.1f}s")
    print(f"total analysis: {t2 - t0:.1f}s for {ranks} ranks (goal < 600s on 2 cores)")
    print(f"projected 10,000 ranks on 64 cores: {proj:.0f}s")
    # the same from CPU seconds (this machine may be shared: wall time then includes waits)
    proj_cpu = (c1 - c0) * 10_000 / ranks / 64 + (t2 - t1) * 10_000 / ranks
    print(
        f"parse+per-rank CPU: {c1 - c0:.1f}s ({(c1 - c0) / ranks * 1e3:.0f} ms/rank); "
        f"projected from CPU time: {proj_cpu:.0f}s"
    )
    print(
        f"slow ranks: {[e['rank'] for e in summary['slow_ranks'][:3]]} (injected {ranks // 2 + 1})"
    )
    if args.dir is None:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
