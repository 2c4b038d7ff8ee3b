"""Orchestration overhead of a GRPO step: the share of wall time outside generation,
training and weight sync (and eval), measured on the default run's steps.

    python bench/grpo_overhead.py [--steps 12] [--base runs/math_base/checkpoints]

Runs ``python -m titan_rl.grpo --config examples/math.yaml`` for a few steps (pretraining
the base first if it is missing, as the main job does) and reads metrics.jsonl: per step,
``time/step`` (wall time of the whole iteration as the driver measures it: from the end of
the previous step's measures, so writing its metrics, printing its line and saving its
checkpoint count too, to the end of this step's eval) against the work:
generation (``time/rollout``, the engines' wall time for the step's requests), training as
the trainer measured it inside its actor (``time/train_compute``, so Ray calls and batch
transfer count as overhead), weight sync (``time/sync``) and eval (``time/eval``). The
first two steps are warm-up. Goal: at most 5%.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_core.training.metrics import read_metrics  # noqa: E402

WARMUP = 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--base", default=None, help="base checkpoint (default: the example's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "titan_rl.grpo", "--config", "examples/math.yaml",
            f"run.dir={tmp}", f"run.num_steps={args.steps}", "run.eval_interval=1000",
            "run.save_interval=0", "sync.check_every=0", "data.num_eval=32",
        ]  # fmt: skip
        if args.base:
            cmd.append(f"policy.load={args.base}")
        wall_start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        total = time.perf_counter() - wall_start
        recs = [r for r in read_metrics(Path(tmp) / "metrics.jsonl") if "time/step" in r]
    recs = recs[WARMUP:]
    parts = ("time/rollout", "time/train_compute", "time/sync", "time/eval")
    fractions = [(r["time/step"] - sum(r[p] for p in parts)) / r["time/step"] for r in recs]
    work = {p: statistics.mean(r[p] for r in recs) for p in parts}
    step = statistics.mean(r["time/step"] for r in recs)
    print(f"steps measured: {len(recs)} (after {WARMUP} warm-up), whole command {total:.1f} s")
    print("mean seconds per step: " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in work.items())
          + f", step {step:.3f}")  # fmt: skip
    print(f"orchestration overhead: {statistics.mean(fractions):.2%} of step wall time "
          f"(median {statistics.median(fractions):.2%}; goal <= 5%)")  # fmt: skip


if __name__ == "__main__":
    main()
