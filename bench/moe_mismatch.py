"""Train/rollout mismatch of MoE GRPO with routing replay off and on (bf16 engine).

    python bench/moe_mismatch.py [--steps 4] [--num-eval 200] [--base runs/math_moe_base/checkpoints]

Runs ``python -m titan_rl.grpo --config examples/math_moe.yaml`` twice from the same base
and seed, ``algo.routing_replay=false`` then ``true`` (the engine returns its routed experts
in both, so agreement is measured in both), and reads each run's metrics.jsonl: the mean
over steps of ``mismatch/kl`` (k3 of the trainer's old logprobs against the rollout's) and
``mismatch/routing_agreement`` (share of token x layer routings where the trainer's *own*
router picks the rollout's experts; with replay the forward itself uses the rollout's
experts, so the replayed routing agrees 1.0 by construction), the eval accuracy at step 0
and at the last step, and the KL ratio off/on.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_core.training.metrics import read_metrics  # noqa: E402

CONFIG = "examples/math_moe.yaml"


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean mismatch/kl and mismatch/routing_agreement over the steps that have them, and
    the first and last eval/accuracy."""
    kl = [r["mismatch/kl"] for r in records if r.get("mismatch/kl") is not None]
    agree = [
        r["mismatch/routing_agreement"]
        for r in records
        if r.get("mismatch/routing_agreement") is not None
    ]
    evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    if not kl or not agree or not evals:
        raise ValueError(
            "metrics.jsonl lacks mismatch/kl, mismatch/routing_agreement or eval/accuracy: "
            "was the run an MoE job with rollout.return_routed_experts on?"
        )
    return {
        "steps": float(len(kl)),
        "kl": statistics.mean(kl),
        "agreement": statistics.mean(agree),
        "eval_first": evals[0],
        "eval_last": evals[-1],
    }


def run_job(replay: bool, steps: int, num_eval: int, base: str | None, run_dir: Path) -> dict:
    """One GRPO run of ``CONFIG``; its summary."""
    cmd = [
        sys.executable, "-m", "titan_rl.grpo", "--config", CONFIG,
        f"run.dir={run_dir}", f"run.num_steps={steps}", "run.eval_interval=100000",
        "run.save_interval=0", "sync.check_every=0", f"data.num_eval={num_eval}",
        f"algo.routing_replay={str(replay).lower()}", "rollout.return_routed_experts=true",
    ]  # fmt: skip
    if base:
        cmd.append(f"policy.load={base}")
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return summarize(read_metrics(run_dir / "metrics.jsonl"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--num-eval", type=int, default=200)
    ap.add_argument("--base", default=None, help="base checkpoint (default: the example's)")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for replay in (False, True):
            name = "on" if replay else "off"
            results[name] = run_job(replay, args.steps, args.num_eval, args.base, Path(tmp) / name)
    for name, s in results.items():
        print(
            f"replay {name:3s}: {int(s['steps'])} steps | mean mismatch/kl {s['kl']:.3e} | "
            f"mean mismatch/routing_agreement (trainer's own router) {s['agreement']:.4f} | "
            f"eval accuracy {s['eval_first']:.3f} -> {s['eval_last']:.3f}"
        )
    print(
        "replayed routing vs rollout with replay on: 1.0 (the forward uses the rollout's experts)"
    )
    ratio = results["off"]["kl"] / results["on"]["kl"] if results["on"]["kl"] else float("inf")
    print(f"mismatch/kl off/on: {ratio:.2f}x")


if __name__ == "__main__":
    main()
