"""HTA vs Titan on the same shared trace files: wall time and peak memory of load +
kernel breakdown, each tool in its own subprocess (peak RSS of it and its children).

Goals: Titan at least 20x faster and at most 1/4 of HTA's peak memory. Titan is measured
cold (no parse cache) and warm (second run over its parse cache).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

TRACES = Path("/work/shared/traces/hta-tests")
DIRS = ["df_index_resolver", "trace_diff/control", "nccl_parser_config", "trace_filter"]

HTA = r"""
import json, logging, resource, sys, time
logging.disable(logging.WARNING)
import warnings; warnings.filterwarnings("ignore")
from hta.trace_analysis import TraceAnalysis
t = time.perf_counter()
ta = TraceAnalysis(trace_dir=sys.argv[1])
kt, _ = ta.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
wall = time.perf_counter() - t
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"wall": wall, "rss_mb": rss / 1024}))
"""

TITAN = r"""
import json, resource, sys, time
from titan_core.trace.analyze import build_summary, load_ranks
cache = sys.argv[2] if sys.argv[2] != "-" else None
t = time.perf_counter()
res, probs = load_ranks(sys.argv[1], cache_dir=cache, progress=False)
s = build_summary(res, probs)
wall = time.perf_counter() - t
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"wall": wall, "rss_mb": rss / 1024}))
"""


def run(code: str, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    print(
        f"{'traces':<22}{'HTA s':>8}{'HTA MB':>8}{'Titan s':>9}{'MB':>7}{'warm s':>8}{'speedup':>9}{'warm x':>8}{'mem ratio':>10}"
    )
    for sub in DIRS:
        d = str(TRACES / sub)
        h = run(HTA, d)
        cold = run(TITAN, d, "-")
        with tempfile.TemporaryDirectory() as cache:
            run(TITAN, d, cache)
            warm = run(TITAN, d, cache)
        print(
            f"{sub:<22}{h['wall']:8.2f}{h['rss_mb']:8.0f}{cold['wall']:9.2f}{cold['rss_mb']:7.0f}"
            f"{warm['wall']:8.2f}{h['wall'] / cold['wall']:8.1f}x{h['wall'] / warm['wall']:7.1f}x"
            f"{cold['rss_mb'] / h['rss_mb']:10.2f}"
        )


if __name__ == "__main__":
    main()
