"""A CPU GRPO run sharing its cores with a busy process: step time with and without one
beside it, for the defaults against how the trainer ran before them (threads = cores).

    python bench/cpu_sharing.py [--steps 6] [--base runs/math_base/checkpoints]
                                [--configs auto,cores] [--repeats 1]

Runs ``python -m titan_rl.grpo --config examples/math.yaml`` (no eval, no checkpoint) for
each config, quiet and then with ``python -c "while True: pass"`` running beside it, and
reads metrics.jsonl: the medians of ``time/step``, ``time/train_compute`` and
``time/rollout`` over the steps after the first (warm-up). The ratio busy / quiet is what
sharing the cores costs; a job that loses one of its cores to the other process should
lose no more than that core's share of its work (2 cores: at most 2x). Configs:

* ``auto``: the defaults (``trainer.num_threads`` and ``engines.num_threads`` unset: the
  placement plan's split of the cores; idle OpenMP threads spinning ~0.4 ms, then sleeping,
  ``GOMP_SPINCOUNT=30000``; Ray's workers at niceness 0);
* ``passive``: the defaults, but idle threads sleeping at once (``OMP_WAIT_POLICY=PASSIVE``,
  the default before the short spin);
* ``cores``: how the trainer ran before those defaults: threads = the cores, libgomp's
  default wait (``GOMP_SPINCOUNT=300000``, its default spin) and Ray's default worker
  niceness (``RAY_worker_niceness=15``);
* ``cores_passive``: threads = the cores, idle threads sleeping, niceness 0 (the threads'
  share of the difference).

The run's environment loses ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``,
``RAY_worker_niceness`` and ``TITAN_CONFIG`` (each config sets what it measures). Without
``--base`` the example's base is used (pretrained first if it is missing, as the main job
does). The machine should be otherwise idle: other work at the default niceness is
competition too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_core.tied_child import popen_tied  # noqa: E402
from titan_core.training.metrics import read_metrics  # noqa: E402
from titan_rl.placement import available_cores  # noqa: E402

KEYS = ("time/step", "time/train_compute", "time/rollout")
DROPPED_ENV = (
    "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "RAY_worker_niceness", "TITAN_CONFIG",
)  # fmt: skip


def configs(cores: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each config: its overrides and its environment on top of the run's."""
    every = [f"trainer.num_threads={cores}", f"engines.num_threads={cores}"]
    return {
        "auto": ([], {}),
        "cores": (every, {"GOMP_SPINCOUNT": "300000", "RAY_worker_niceness": "15"}),
        "cores_passive": (every, {}),
        "passive": ([], {"OMP_WAIT_POLICY": "PASSIVE"}),
    }


@contextlib.contextmanager
def busy(on: bool) -> Iterator[None]:
    """A process spinning on one core for the duration (nothing when ``on`` is false)."""
    if not on:
        yield
        return
    proc = popen_tied([sys.executable, "-c", "while True: pass"])  # dies with this bench
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def run(steps: int, base: str | None, overrides: list[str], env: dict[str, str]) -> dict:
    """One short run; the medians of :data:`KEYS` over its steps after the first."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "titan_rl.grpo", "--config", "examples/math.yaml",
            f"run.dir={tmp}", f"run.num_steps={steps}", "run.eval_interval=null",
            "run.save_interval=null", "sync.check_every=0", *overrides,
        ]  # fmt: skip
        if base:
            cmd.append(f"policy.load={base}")
        child = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV} | env
        proc = subprocess.run(cmd, cwd=REPO, env=child, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        recs = [r for r in read_metrics(Path(tmp) / "metrics.jsonl") if "time/step" in r][1:]
    return {k: statistics.median(r[k] for r in recs) for k in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--base", default=None, help="base checkpoint (default: the example's)")
    ap.add_argument(
        "--configs", default="auto,cores", help="of auto, passive, cores, cores_passive"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (config, load)")
    args = ap.parse_args()
    cores = available_cores()
    table = configs(cores)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {list(table)}")
    results: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(args.repeats):  # interleaved, so a drift in the machine's load hits all
        for loaded in (False, True):
            for name in names:
                overrides, env = table[name]
                with busy(loaded):
                    got = run(args.steps, args.base, overrides, env)
                results.setdefault((name, loaded), []).append(got)
                print(f"{name:>13} {'busy' if loaded else 'quiet':>5}: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)  # fmt: skip
    print(f"\n{cores} core(s); medians over steps 2..{args.steps}, seconds "
          f"(median of {args.repeats} run(s) each); ratio = busy / quiet")  # fmt: skip
    print(f"{'config':>13} | " + " | ".join(f"{k[5:]:>28}" for k in KEYS))
    for name in names:
        cells = []
        for k in KEYS:
            quiet = statistics.median(r[k] for r in results[(name, False)])
            loaded = statistics.median(r[k] for r in results[(name, True)])
            cells.append(f"{quiet:7.3f} -> {loaded:7.3f} ({loaded / quiet:5.2f}x)")
        print(f"{name:>13} | " + " | ".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
