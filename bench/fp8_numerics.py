"""Blockwise FP8 numerics: a small GPT trained in fp32 and in emulated blockwise FP8.

    python bench/fp8_numerics.py [--steps 300] [--sequential]

Runs ``python -m titan_core.pretrain --config examples/pretrain_tiny.yaml`` (shrunk to 2
layers, hidden 128, FFN 256, 64-token sequences, 16 per step, so both runs fit in ~3
minutes on 2 CPU cores) twice from the same seed and data: fp32, and ``train.fp8=e4m3`` (on CPU the
emulation of TE's Float8BlockScaling in titan_core/fp8). The two runs go side by side (one
thread each) unless ``--sequential``. Prints:

- the final loss of each (train: mean of the last 20 steps' losses; eval: 8 held-out
  batches after the last step) and the gaps fp8 / fp32 - 1 (goal: within 1%);
- per-GEMM relative error (Frobenius, against fp32) of forward, dgrad and wgrad for each
  linear of decoder layer 0, on the fp32 run's final weights and one real batch (its
  inputs and output gradients captured in fp32).

On a CUDA GPU with Transformer Engine it also times bf16 against bf16 + FP8 (megatron-core
with TE's Float8BlockScaling, ``train.fp8_recipe=blockwise``) on a larger model and prints
the median step times and their ratio; elsewhere it says that part is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "pretrain_tiny.yaml"
SMALL = [
    "model.num_layers=2",
    "model.ffn_hidden_size=256",
    "model.seq_length=64",
    "model.max_position_embeddings=64",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.lr_warmup_iters=20",
    "train.eval_iters=8",
    "data.num_samples=20000",
]
#: the GPU timing model: TE FP8 GEMMs want dims that are multiples of 16 (here of 128).
GPU_MODEL = [
    "model.num_layers=8",
    "model.hidden_size=2048",
    "model.num_attention_heads=16",
    "model.ffn_hidden_size=8192",
    "model.seq_length=2048",
    "model.max_position_embeddings=2048",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.lr_warmup_iters=2",
    "data.num_samples=20000",
    "train.bf16=true",
]
TAIL = 20


def _pretrain(run_dir: Path, overrides: list[str], threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "titan_core.pretrain", "--config", str(CONFIG),
           *overrides, f"run.dir={run_dir}"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _wait(procs: dict[str, subprocess.Popen]) -> None:
    for name, p in procs.items():
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"the {name} run failed ({p.returncode}):\n{err[-3000:]}")


def _records(run_dir: Path) -> list[dict]:
    from titan_core.training.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def loss_gap(steps: int, sequential: bool, work: Path) -> dict[str, float]:
    """Train both runs; the final losses and fp8 / fp32 - 1."""
    common = [*SMALL, f"train.train_iters={steps}", f"checkpoint.save_interval={steps}",
              f"train.eval_interval={steps}"]  # fmt: skip
    runs = {"fp32": common, "fp8": [*common, "train.fp8=e4m3"]}
    procs: dict[str, subprocess.Popen] = {}
    for name, overrides in runs.items():
        procs[name] = _pretrain(work / name, overrides, threads=1 if not sequential else 2)
        if sequential:
            _wait({name: procs.pop(name)})
    _wait(procs)
    final = {}
    for name in runs:
        records = _records(work / name)
        final[name] = statistics.fmean(r["loss"] for r in records[-TAIL:])
        final[f"{name}_eval"] = records[-1]["eval/loss"]
    final["gap"] = final["fp8"] / final["fp32"] - 1
    final["eval_gap"] = final["fp8_eval"] / final["fp32_eval"] - 1
    return final


def gemm_errors(run_dir: Path) -> dict[str, dict[str, float]]:
    """Relative error of each emulated FP8 GEMM of layer 0 on the trained fp32 model."""
    import torch

    from titan_core.accelerator import megatron_scope
    from titan_core.config import load_config
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.data.gpt import build_gpt_datasets, microbatches
    from titan_core.fp8 import BlockwiseFp8Linear, BlockwiseRecipe
    from titan_core.parallel.initialize import initialize, shutdown
    from titan_core.training.loop import Trainer

    cfg = load_config(
        PretrainConfig,
        CONFIG,
        [*SMALL, f"run.dir={run_dir / 'gemm'}", f"checkpoint.pretrained_checkpoint={run_dir / 'checkpoints'}"],
    )  # fmt: skip
    accel, _, dp = initialize(cfg)
    try:
        trainer = Trainer(cfg, accel, dp)
        trainer.maybe_resume()
        model = trainer.model[0]
        layer = model.module.decoder.layers[0]
        linears = {
            "qkv": layer.self_attention.linear_qkv,
            "proj": layer.self_attention.linear_proj,
            "fc1": layer.mlp.linear_fc1,
            "fc2": layer.mlp.linear_fc2,
        }
        seen: dict[str, dict[str, torch.Tensor]] = {}

        def capture(name: str):  # noqa: ANN202
            def hook(module, inputs, output) -> None:  # noqa: ANN001
                seen[name] = {"x": inputs[0].detach().flatten(0, -2)}
                output[0].register_hook(
                    lambda g: seen[name].__setitem__("g", g.detach().flatten(0, -2))
                )

            return hook

        for name, lin in linears.items():
            lin.register_forward_hook(capture(name))
        train_ds, _ = build_gpt_datasets(cfg, trainer.tokenizer, cfg.train.global_batch_size, 0)
        batch = next(microbatches(train_ds, cfg.train.micro_batch_size, 1, 0, 1, 0))
        with megatron_scope():
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            mask = batch["loss_mask"].float()
            ((per_token.float() * mask).sum() / mask.sum()).backward()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a.double() - b.double()).norm() / b.double().norm()).item()

        out = {}
        for name, lin in linears.items():
            x, g = seen[name]["x"].float(), seen[name]["g"].float()
            w = lin.weight.detach().float()
            xq, wq = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            y = BlockwiseFp8Linear.apply(xq, wq, BlockwiseRecipe())
            y.backward(g)
            out[name] = {
                "shape": f"[{x.shape[0]}x{x.shape[1]}] @ [{w.shape[0]}x{w.shape[1]}]^T",
                "forward": rel(y.detach(), x @ w.t()),
                "dgrad": rel(xq.grad, g @ w),
                "wgrad": rel(wq.grad, g.t() @ x),
            }
        return out
    finally:
        shutdown()


def gpu_step_time(steps: int, work: Path) -> str:
    """bf16 vs bf16 + FP8 (TE Float8BlockScaling) median step time, on a CUDA GPU with TE."""
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return "GPU step time: skipped (needs a CUDA GPU with Transformer Engine)"
    common = [*GPU_MODEL, f"train.train_iters={steps}", "checkpoint.save_interval=0",
              "model.transformer_impl=transformer_engine"]  # fmt: skip
    runs = {"bf16": common, "bf16+fp8": [*common, "train.fp8=e4m3", "train.fp8_recipe=blockwise"]}
    times = {}
    for name, overrides in runs.items():
        _wait({name: _pretrain(work / name, overrides, threads=4)})
        step_s = [r["step_time_s"] for r in _records(work / name)][3:]  # warm-up dropped
        times[name] = statistics.median(step_s)
    return (
        f"GPU step time ({torch.cuda.get_device_name()}, {' '.join(GPU_MODEL[:4])}): "
        f"bf16 {times['bf16'] * 1e3:.1f} ms, bf16+fp8 {times['bf16+fp8'] * 1e3:.1f} ms, "
        f"fp8/bf16 {times['bf16+fp8'] / times['bf16']:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sequential", action="store_true", help="one run after the other")
    ap.add_argument("--gpu-steps", type=int, default=30)
    ap.add_argument("--gemm-errors", type=Path, help=argparse.SUPPRESS)  # internal: a run dir
    args = ap.parse_args()
    if args.gemm_errors:  # in its own process: it starts a process group
        print(json.dumps(gemm_errors(args.gemm_errors)))
        return
    with tempfile.TemporaryDirectory(prefix="fp8_numerics_") as tmp:
        work = Path(tmp)
        final = loss_gap(args.steps, args.sequential, work)
        print(f"{args.steps} steps, same seed and data; goal: gap within 1%")
        print(f"  {'':<34}{'fp32':>8}{'fp8':>8}{'fp8/fp32 - 1':>14}")
        print(
            f"  {f'train loss, mean of last {TAIL} steps':<34}{final['fp32']:>8.4f}"
            f"{final['fp8']:>8.4f}{final['gap'] * 100:>+13.2f}%"
        )
        print(
            f"  {'eval loss after the last step':<34}{final['fp32_eval']:>8.4f}"
            f"{final['fp8_eval']:>8.4f}{final['eval_gap'] * 100:>+13.2f}%"
        )
        proc = subprocess.run(
            [sys.executable, __file__, "--gemm-errors", str(work / "fp32")],
            capture_output=True, text=True, cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore"),
        )  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"GEMM error measurement failed:\n{proc.stderr[-3000:]}")
        errors = json.loads(proc.stdout.strip().splitlines()[-1])
        print("per-GEMM relative error vs fp32, decoder layer 0, trained weights, one batch:")
        print(f"  {'GEMM':<6}{'shape':<28}{'forward':>10}{'dgrad':>10}{'wgrad':>10}")
        for name, e in errors.items():
            print(
                f"  {name:<6}{e['shape']:<28}{e['forward']:>10.2e}{e['dgrad']:>10.2e}"
                f"{e['wgrad']:>10.2e}"
            )
        print(gpu_step_time(args.gpu_steps, work))


if __name__ == "__main__":
    main()
