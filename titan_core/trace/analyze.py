"""Run the whole analysis over a folder of per-rank traces and build ``summary.json``.

Files are parsed and reduced to a compact per-rank result right away, so a rank's events
never outlive its file: in this process for small jobs (a worker process costs more to
start than a few MB of trace take to parse), in worker processes on all cores for larger
ones, or as Ray tasks across nodes with ``use_ray``. The cross-rank analyses then work on
those small results.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from titan_core.trace.breakdown import RankResult, analyze_rank
from titan_core.trace.cache import load_cached
from titan_core.trace.categories import TraceConfig, busbw_factor
from titan_core.trace.clock import clock_offsets
from titan_core.trace.critical_path import analyze_steps
from titan_core.trace.forked import Forked
from titan_core.trace.gc_pause import gc_paused
from titan_core.trace.intervals import median
from titan_core.trace.matching import op_keys, participants
from titan_core.trace.moe_load import moe_load_rows
from titan_core.trace.parse import SUMMARY_FORMAT, TraceError, find_trace_files
from titan_core.trace.pipeline import pipeline_groups, pipeline_report, resolve_peers
from titan_core.trace.stragglers import slow_ranks


def _work(
    path: str, cfg: TraceConfig, cache_dir: str | None, parts: int = 1
) -> RankResult | tuple[str, str]:
    try:
        with gc_paused():
            rt = load_cached(path, cfg, cache_dir, parts)
            return analyze_rank(rt, cfg, -1 if rt.rank is None else rt.rank)
    except TraceError as exc:
        return (path, str(exc))
    except Exception as exc:  # one bad file must not stop the others
        return (path, f"{type(exc).__name__}: {exc}")


def _forked_map(
    files: list[str], cfg: TraceConfig, cache: str | None, workers: int
) -> Iterator[RankResult | tuple[str, str]]:
    """:func:`_work` over ``files``: this process takes every ``workers``-th file and
    forked helpers the others, each sending its results back pickled."""

    def share_work(share: list[str]) -> bytes:
        return pickle.dumps([_work(f, cfg, cache) for f in share])

    shares = [files[i::workers] for i in range(min(workers, len(files)))]
    helpers: list[tuple[Forked, list[str]]] = []
    try:
        for share in shares[1:]:
            helpers.append((Forked(partial(share_work, share)), share))
        for f in shares[0]:
            yield _work(f, cfg, cache)
        for helper, share in helpers:
            data = helper.result()
            if data:
                yield from pickle.loads(data)
            else:  # the helper died: its files are parsed here
                for f in share:
                    yield _work(f, cfg, cache)
    finally:
        for helper, _share in helpers:
            helper.close()


#: below this many compressed bytes per extra worker, parse in this process
INLINE_BYTES_PER_WORKER = 8 << 20


def _small(files: list[str], workers: int) -> bool:
    """Whether the job is too small for worker processes to pay off (starting one and
    importing the analyzer in it takes a few hundred ms, about what parsing 8 MB of
    compressed trace takes)."""
    size = 0
    for f in files:
        with contextlib.suppress(OSError):
            size += os.path.getsize(f)
    return size < INLINE_BYTES_PER_WORKER * min(workers, len(files))


@gc_paused()
def load_ranks(
    trace_dir: str | Path,
    cfg: TraceConfig | None = None,
    workers: int | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    use_ray: bool = False,
    exclude: tuple[str | Path, ...] | list[str | Path] = (),
) -> tuple[list[RankResult], list[dict[str, str]]]:
    """Parse and reduce every trace file (but those below the folders in ``exclude``, see
    :func:`~titan_core.trace.parse.find_trace_files`); returns results and the problem
    files."""
    cfg = cfg or TraceConfig()
    files = [str(p) for p in find_trace_files(trace_dir, exclude)]
    cache = None if cache_dir is None else str(cache_dir)
    workers = workers or os.cpu_count() or 1
    raw: list[Any] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(files), desc="parsing traces", unit="file")
    if use_ray:
        import ray  # optional: only for jobs spread over several nodes

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)
        task = ray.remote(_work)
        refs = [task.remote(f, cfg, cache) for f in files]
        while refs:
            ready, refs = ray.wait(refs, num_returns=1)
            raw.append(ray.get(ready[0]))
            if bar:
                bar.update(1)
    elif workers <= 1 or len(files) <= 1 or _small(files, workers):
        if len(files) > 1 and workers > 1 and sys.platform == "linux":
            # a few small files: one forked helper per core (no interpreter to start)
            for item in _forked_map(files, cfg, cache, workers):
                raw.append(item)
                if bar:
                    bar.update(1)
        else:
            for f in files:  # one at a time, each big one decoded by all workers
                raw.append(_work(f, cfg, cache, parts=workers))
                if bar:
                    bar.update(1)
    else:
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from multiprocessing import get_context

        with ProcessPoolExecutor(min(workers, len(files)), mp_context=get_context("spawn")) as ex:
            futs = [ex.submit(_work, f, cfg, cache) for f in files]
            for fut in as_completed(futs):
                raw.append(fut.result())
                if bar:
                    bar.update(1)
    if bar:
        bar.close()
    results: list[RankResult] = []
    problems: list[dict[str, str]] = []
    for item in raw:
        if isinstance(item, tuple):
            problems.append({"file": item[0], "reason": item[1]})
        else:
            results.append(item)
    rankless = [r for r in results if r.rank < 0]
    if rankless:
        if len(results) == 1:
            rankless[0].rank = 0
            rankless[0].warnings.append("no rank information; analyzed as rank 0 (only file)")
        else:
            for r in rankless:
                problems.append(
                    {"file": r.path, "reason": "no rank information (distributedInfo.rank)"}
                )
            results = [r for r in results if r.rank >= 0]
    seen: dict[int, str] = {}
    unique = []
    for r in sorted(results, key=lambda x: (x.rank, x.path)):
        if r.rank in seen:
            problems.append(
                {"file": r.path, "reason": f"duplicate rank {r.rank} (also {seen[r.rank]})"}
            )
            continue
        seen[r.rank] = r.path
        unique.append(r)
    return unique, problems


def _comm_summary(results: list[RankResult]) -> list[dict[str, Any]]:
    agg: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        for op in r.comm_ops:
            k = (op.collective, op.pg)
            a = agg.setdefault(
                k,
                {
                    "collective": op.collective,
                    "process_group": op.pg,
                    "algorithms": set(),
                    "count": 0,
                    "time_us": 0,
                    "bytes": 0,
                    "busbw": [],
                    "sizes": [],
                },
            )
            a["count"] += 1
            a["time_us"] += op.dur
            a["bytes"] += op.nbytes
            if op.algo:
                a["algorithms"].add(op.algo)
            if op.nbytes and op.dur > 0:
                n = op.group_size or (len(op.pg_ranks) if op.pg_ranks else 2)
                a["busbw"].append(op.nbytes / op.dur / 1e3 * busbw_factor(op.collective, n))
                a["sizes"].append(op.nbytes)
    out = []
    for a in agg.values():
        bw, sizes = a.pop("busbw"), a.pop("sizes")
        a["algorithms"] = sorted(a["algorithms"])
        a["median_msg_bytes"] = int(median(sizes)) if sizes else 0
        a["median_busbw_GBps"] = round(median(bw), 3) if bw else None
        a["max_busbw_GBps"] = round(float(max(bw)), 3) if bw else None
        out.append(a)
    out.sort(key=lambda a: -a["time_us"])
    return out


def _rank_entry(r: RankResult) -> dict[str, Any]:
    steps = []
    for s in r.steps:
        steps.append(
            {
                "step": s.step,
                "step_time_us": s.end - s.start,
                "computation_us": s.computation,
                "communication_exposed_us": s.communication,
                "memory_exposed_us": s.memory,
                "idle_us": s.idle,
                "comm_comp_overlap_us": s.overlap,
                "comm_total_us": s.comm_total,
                "overlap_pct": round(100 * s.overlap / s.comm_total, 2) if s.comm_total else None,
                "idle_split_us": {
                    "host_wait": s.host_wait,
                    "kernel_wait": s.kernel_wait,
                    "other": s.other_wait,
                },
            }
        )
        if s.phases:  # RL steps: time in rollout / train / sync
            steps[-1]["rl_phases_us"] = dict(sorted(s.phases.items()))
    return {
        "rank": r.rank,
        "file": r.path,
        "device": r.meta.get("device"),
        "compute_stream": r.compute_stream,
        "kernel_time_us": r.kernel_time_us,
        "kernel_counts": r.kernel_counts,
        "steps": steps,
        "top_kernels": r.top_kernels[:10],
        "comm_ops": len(r.comm_ops),
        "warnings": r.warnings,
    }


@gc_paused()
def build_summary(
    results: list[RankResult], problems: list[dict[str, str]], pp: int | None = None
) -> dict[str, Any]:
    """The cross-rank analyses; the returned dict is what ``summary.json`` holds."""
    groups = pipeline_groups(results, pp) if results else []
    resolve_peers(results, groups)
    keys = op_keys(results, groups)
    parts = participants(keys)
    offsets = clock_offsets(results, parts)
    peer_class: dict[int, Any] = {}
    for g in groups:
        for s, rank in enumerate(g):
            peer_class[rank] = s
    slow = slow_ranks(results, parts, offsets, peer_class)
    pipe = pipeline_report(results, groups, offsets)
    # what-if candidates: the slow ranks, else the slowest computing ranks
    cands = [e["rank"] for e in slow[:4]]
    if not cands and results:
        tot = sorted(results, key=lambda r: -sum(s.computation for s in r.steps))
        cands = [r.rank for r in tot[:2]]
    cp = analyze_steps(results, keys, offsets, peer_class, cands) if results else {"steps": []}
    kernels: dict[tuple[str, str], dict[str, Any]] = defaultdict(
        lambda: {"count": 0, "sum_us": 0, "max_us": 0}
    )
    for r in results:
        for k in r.top_kernels:
            e = kernels[(k["name"], k["kind"])]
            e["count"] += k["count"]
            e["sum_us"] += k["sum_us"]
            e["max_us"] = max(e["max_us"], k["max_us"])
    top = sorted(
        ({"name": n, "kind": kd, **v} for (n, kd), v in kernels.items()),
        key=lambda x: -x["sum_us"],
    )[:30]
    return {
        "format": SUMMARY_FORMAT,  # first: how a later run knows this file for a report
        "num_ranks": len(results),
        "problems": problems,
        "ranks": [_rank_entry(r) for r in results],
        "top_kernels": top,
        "communication": _comm_summary(results),
        "clock_offsets_us": {str(k): round(v, 1) for k, v in sorted(offsets.items())},
        "slow_ranks": slow,
        "pipeline": pipe,
        "critical_path": cp,
    }


@gc_paused()
def analyze_traces(
    trace_dir: str | Path,
    cfg: TraceConfig | None = None,
    workers: int | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    use_ray: bool = False,
    pp: int | None = None,
    exclude: tuple[str | Path, ...] | list[str | Path] = (),
) -> tuple[dict[str, Any], list[RankResult]]:
    """What ``python -m titan_core.trace analyze`` computes: :func:`load_ranks` then
    :func:`build_summary`, with the cyclic GC paused across both (turned back on between
    them, it would at once rescan every result just built). Returns the summary and the
    per-rank results (the report draws from both)."""
    results, problems = load_ranks(
        trace_dir, cfg, workers, cache_dir, progress, use_ray, exclude=exclude
    )
    summary = build_summary(results, problems, pp=pp)
    traced = {s.step for r in results for s in r.steps}
    summary["moe_load"] = moe_load_rows(trace_dir, traced or None)  # the run's metrics.jsonl
    return summary, results
