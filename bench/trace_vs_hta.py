"""HTA vs Titan on the same shared trace files: wall time and peak memory of load +
breakdowns, each tool in its own subprocess (peak RSS of it and its children).

"Breakdowns" are the ones Titan's summary reports and HTA has: the GPU kernel breakdown,
the temporal breakdown (compute / non-compute / idle per rank) and comm/compute overlap.
Titan's side is everything ``titan_core.trace analyze`` computes (``analyze_traces``:
``load_ranks`` + ``build_summary``, also comm, stragglers, pipeline and critical path). The
HTA time of load + kernel breakdown alone is printed too, with its ratio ("kernel x").
Neither tool's time includes importing it; those imports are timed on their own and
printed ("import s": HTA pulls in pandas and its plotting stack, Titan only msgspec).

The command a user runs is timed too ("command s"): ``python -m titan_core.trace analyze
DIR --out OUT --no-cache --quiet`` in a fresh process, from its start to its exit as the
bench sees it (interpreter start, imports, analysis, writing summary.json and
report.html), with its ratio to HTA's load + kernel breakdown ("cmd x"; HTA's import and
interpreter start not counted, so the ratio leans against Titan). "report s" is the
report's own time (importing the report module and writing report.html), after a cold
analysis in the same process. Python's bytecode is compiled once before the rounds (into a
temporary PYTHONPYCACHEPREFIX), as pip does at install: compiling Titan from source would
add ~25 ms to each command.

Goals: Titan's analysis at least 20x faster and at most 1/4 of HTA's peak memory; the
whole command at least 8x faster than HTA's load + kernel breakdown; the report under
0.2 s. Titan is measured cold (no parse cache) and warm (second run over its parse cache).

On a shared machine wall times swing with the load, so each tool also reports its CPU time
(user + system, children included), and ``--repeat N`` runs every measurement N times,
interleaved, and prints the medians. The speedups are medians of per-round ratios (HTA's
run against Titan's right after it): on a virtual machine whose speed drifts by up to 2x
over minutes, a ratio of two runs made seconds apart is steadier than a ratio of medians
taken over the whole session. ``range`` gives the lowest and highest round's cold speedup.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# shared/ lies beside the checkout (CI copies it there); TITAN_SHARED overrides.
TRACES = (
    Path(os.environ.get("TITAN_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")
    / "traces"
    / "hta-tests"
)
DIRS = ["df_index_resolver", "trace_diff/control", "nccl_parser_config", "trace_filter"]

HTA = r"""
import json, logging, resource, sys, time
logging.disable(logging.WARNING)
import warnings; warnings.filterwarnings("ignore")
t_imp = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
imp = time.perf_counter() - t_imp
c0 = sum(x.ru_utime + x.ru_stime for x in (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
t = time.perf_counter()
ta = TraceAnalysis(trace_dir=sys.argv[1])
kt, _ = ta.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
kernel_wall = time.perf_counter() - t
ta.get_temporal_breakdown(visualize=False)
ta.get_comm_comp_overlap(visualize=False)
wall = time.perf_counter() - t
u = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
cpu = sum(x.ru_utime + x.ru_stime for x in u) - c0
rss = max(x.ru_maxrss for x in u)
print(json.dumps({"wall": wall, "kernel_wall": kernel_wall, "cpu": cpu, "rss_mb": rss / 1024, "import": imp}))
"""

TITAN = r"""
import json, resource, sys, time
t_imp = time.perf_counter()
from titan_core.trace.analyze import analyze_traces
imp = time.perf_counter() - t_imp
cache = sys.argv[2] if sys.argv[2] != "-" else None
c0 = sum(x.ru_utime + x.ru_stime for x in (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
t = time.perf_counter()
summary, results = analyze_traces(sys.argv[1], cache_dir=cache, progress=False)
wall = time.perf_counter() - t
u = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
cpu = sum(x.ru_utime + x.ru_stime for x in u) - c0
rss = max(x.ru_maxrss for x in u)
t = time.perf_counter()
from titan_core.trace.report import write_report
write_report(summary, results, sys.argv[3])
report = time.perf_counter() - t
print(json.dumps({"wall": wall, "cpu": cpu, "rss_mb": rss / 1024, "import": imp, "report": report}))
"""

#: one process for everything, as a user would start it
COMMAND = [sys.executable, "-m", "titan_core.trace", "analyze"]


def run(code: str, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _children_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def run_command(trace_dir: str, out_dir: str) -> dict:
    """Wall and CPU time of the whole command, cold, from outside its process."""
    c0, t = _children_cpu(), time.perf_counter()
    subprocess.run(
        [*COMMAND, trace_dir, "--out", out_dir, "--no-cache", "--quiet"],
        capture_output=True,
        check=True,
    )
    return {"wall": time.perf_counter() - t, "cpu": _children_cpu() - c0}


def _compile_bytecode() -> None:
    """Have every process read compiled bytecode, as from an installed package: point
    Python at a temporary bytecode folder and import both tools once to fill it."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    prefix = tempfile.mkdtemp(prefix="trace_vs_hta_pyc_")
    atexit.register(shutil.rmtree, prefix, ignore_errors=True)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import hta.trace_analysis, titan_core.trace.__main__, "
            "titan_core.trace.analyze, titan_core.trace.report",
        ],
        capture_output=True,
        check=True,
    )


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _ratios(num: list[dict], num_key: str, den: list[dict], den_key: str) -> list[float]:
    """Per round, one tool's figure over the other's (their runs were made seconds apart)."""
    return [a[num_key] / max(b[den_key], 1e-3) for a, b in zip(num, den, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1, help="runs per measurement (medians)")
    args = ap.parse_args()
    _compile_bytecode()
    print(
        f"{'traces':<22}{'HTA s':>8}{'HTA MB':>8}{'Titan s':>9}{'MB':>7}{'warm s':>8}{'speedup':>9}"
        f"{'range':>13}{'warm x':>8}{'kernel x':>9}{'mem ratio':>10}{'HTA cpu':>9}"
        f"{'Titan cpu':>10}{'cpu x':>8}{'import s HTA/Titan':>20}"
    )
    command_rows = []
    for sub in DIRS:
        d = str(TRACES / sub)
        hs, colds, warms, cmds = [], [], [], []
        with tempfile.TemporaryDirectory() as out:
            for _ in range(args.repeat):
                hs.append(run(HTA, d))
                cmds.append(run_command(d, out))
                colds.append(run(TITAN, d, "-", os.path.join(out, "report.html")))
                with tempfile.TemporaryDirectory() as cache:
                    run(TITAN, d, cache, os.devnull)
                    warms.append(run(TITAN, d, cache, os.devnull))
        h, cold, warm, cmd = _median(hs), _median(colds), _median(warms), _median(cmds)
        speedups = _ratios(hs, "wall", colds, "wall")
        speedup = statistics.median(speedups)
        warm_x = statistics.median(_ratios(hs, "wall", warms, "wall"))
        kernel_x = statistics.median(_ratios(hs, "kernel_wall", colds, "wall"))
        mem = statistics.median(_ratios(colds, "rss_mb", hs, "rss_mb"))
        cpu_x = statistics.median(_ratios(hs, "cpu", colds, "cpu"))
        spread = f"{min(speedups):.1f}-{max(speedups):.1f}x"
        print(
            f"{sub:<22}{h['wall']:8.2f}{h['rss_mb']:8.0f}{cold['wall']:9.3f}{cold['rss_mb']:7.0f}"
            f"{warm['wall']:8.3f}{speedup:8.1f}x{spread:>13}{warm_x:7.1f}x{kernel_x:8.1f}x"
            f"{mem:10.2f}{h['cpu']:9.2f}{cold['cpu']:10.2f}{cpu_x:7.1f}x"
            f"{h['import']:13.2f}/{cold['import']:.3f}",
            flush=True,
        )
        cmd_x = _ratios(hs, "kernel_wall", cmds, "wall")
        command_rows.append(
            f"{sub:<22}{h['kernel_wall']:14.2f}{cmd['wall']:11.3f}{cmd['cpu']:10.3f}"
            f"{statistics.median(cmd_x):8.1f}x{f'{min(cmd_x):.1f}-{max(cmd_x):.1f}x':>13}"
            f"{cold['report']:10.4f}"
        )
    print(
        f"\n{'traces':<22}{'HTA kernel s':>14}{'command s':>11}{'cmd cpu':>10}{'cmd x':>9}"
        f"{'range':>13}{'report s':>10}"
    )
    print("\n".join(command_rows))


if __name__ == "__main__":
    main()
