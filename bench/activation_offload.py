"""Activation offload (``train.offload_modules``): resident saved activations, gradients, step time.

Runs Titan's pretraining step (megatron-core schedules, 2 processes: gloo on CPU, one device
each on a GPU host) on a small dense
GPT under 1F1B (PP=2) and interleaved VPP (PP=2 x VPP=2), without offload and with each
module choice megatron-core 0.16.1 accepts for a dense GPT, and prints per pipeline stage:

* the peak bytes of activations saved for backward that stay resident (counted by
  ``titan_core.training.saved_activations``; parameters excluded), as a ratio to no offload
  (first step: megatron's warm-up step, which offloads every group; steady: the next step,
  where megatron keeps the last group of each name resident so reloads never block);
* whether every parameter gradient after each counted step is bit-identical (fp32,
  ``torch.equal``) to no offload;
* the median step time (steps run without the counter) as a ratio to no offload; on a GPU
  also ``max_memory_allocated`` per step.

The model's tensors are below megatron's default 1M-element offload floor, so the bench sets
``train.offload_min_tensor_size=0``. ``--json FILE`` writes the rows.

Two cases add megatron's selective recompute of the dense MLP (``train.recompute_modules=
[mlp]``), alone and with the five attention + MLP inputs offloaded: the MLP's interior has no
offload switch, so recomputing it is what takes the resident peak further down.

expert_fc1 / moe_act are left out: megatron-core 0.16.1 honours them only in TEGroupedMLP
(Transformer Engine); the local SequentialMLP used without TE ignores them.

    python bench/activation_offload.py [--steps 5] [--cases off,attention_mlp] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: name -> offload_modules (dense GPT; attn_proj is only valid together with core_attn)
CASES: dict[str, list[str]] = {
    "off": [],
    "attn_norm": ["attn_norm"],
    "qkv_linear": ["qkv_linear"],
    "core_attn": ["core_attn"],
    "core_attn+attn_proj": ["core_attn", "attn_proj"],
    "mlp_norm": ["mlp_norm"],
    "attention": ["attn_norm", "qkv_linear", "core_attn", "attn_proj"],
    "attention_mlp": ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"],
    "recompute_mlp": [],
    "attention_mlp+recompute_mlp": [
        "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
    ],
}  # fmt: skip
#: what a case sets besides offload_modules: the dense MLP's interior (fc1's input and
#: output, the activation's output), which no offload switch covers, recomputed in backward
#: instead (megatron's selective recompute, train.recompute_modules=[mlp])
EXTRA: dict[str, list[str]] = {
    "recompute_mlp": ["train.recompute_granularity=selective", "train.recompute_modules=[mlp]"],
    "attention_mlp+recompute_mlp": [
        "train.recompute_granularity=selective", "train.recompute_modules=[mlp]",
    ],
}  # fmt: skip
SCHEDULES: dict[str, list[str]] = {
    "1F1B PP2": ["parallel.pipeline_model_parallel_size=2"],
    "VPP PP2xVPP2": [
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
    ],
}
#: a small fp32 GPT: 4 layers (1 per VPP chunk), 4 microbatches per step. LayerNorm: torch's
#: RMSNorm is composite (its input feeds two ops), and the identity node megatron inserts
#: before an offloaded norm then changes autograd's fp32 summation order of that input's
#: gradient (1-ulp differences with attn_norm / mlp_norm; ``--set model.normalization=RMSNorm``)
SHAPE = [
    "model.normalization=LayerNorm",
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=256",
    "model.seq_length=64",
    "model.max_position_embeddings=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=16",
    "train.lr_warmup_iters=1",
    "train.offload_min_tensor_size=0",
    "checkpoint.save_interval=0",
    "data.num_samples=2000",
]
COUNTED_STEPS = 2


# ---- one process (a pipeline rank) ----------------------------------------------------
def _run_case(overrides: list[str], timed_steps: int, run_dir: str) -> dict[str, Any]:
    """Build a fresh trainer, run the counted steps (grads kept) and the timed steps."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface,
    )

    from titan_core.accelerator.megatron_compat import megatron_scope
    from titan_core.config import load_config
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.data.gpt import build_gpt_datasets
    from titan_core.parallel.initialize import initialize
    from titan_core.training.loop import Trainer
    from titan_core.training.saved_activations import SavedActivationCounter

    cfg = load_config(
        PretrainConfig,
        str(REPO / "examples/pretrain_tiny.yaml"),
        [*overrides, f"run.dir={run_dir}"],
    )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    accel, _, dp = initialize(cfg)  # also reseeds: every case starts from the same weights
    with megatron_scope():  # megatron's offload manager is a process-wide singleton
        FineGrainedActivationOffloadingInterface.reset_instance()
    trainer = Trainer(cfg, accel, dp)
    params = [p for chunk in trainer.model for p in chunk.parameters()]
    steps = COUNTED_STEPS + timed_steps
    train_ds, _ = build_gpt_datasets(cfg, trainer.tokenizer, steps * cfg.train.global_batch_size, 0)
    data = trainer.data_iterators(train_ds)
    device_mod = accel.accelerator_module if accel.device_type != "cpu" else None
    peaks, grads, device_peaks, times = [], [], [], []
    quiet = io.StringIO()  # megatron prints an offload table after its warm-up step
    for step in range(1, steps + 1):
        trainer.step = step
        if device_mod is not None:
            device_mod.reset_peak_memory_stats()
        with contextlib.redirect_stdout(quiet):
            if step <= COUNTED_STEPS:
                with SavedActivationCounter(exclude=params) as counter:
                    trainer.train_step(data)
                peaks.append((counter.peak_resident_bytes, counter.peak_offloaded_bytes))
                grads.append([_grad(p).clone() for p in params])
            else:
                accel.synchronize()
                start = time.perf_counter()
                trainer.train_step(data)
                accel.synchronize()
                times.append(time.perf_counter() - start)
        if device_mod is not None:
            device_peaks.append(int(device_mod.max_memory_allocated()))
    del trainer
    return {
        "peaks": peaks,
        "grads": grads,
        "step_time_s": statistics.median(times) if times else float("nan"),
        "device_max_allocated": device_peaks,
        "dtype": str(torch.float32),
    }


def _grad(p: Any) -> Any:
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rows = []
    run_dir = args.run_dir
    for sched in args.schedules:
        ref: dict[str, Any] | None = None
        for case in args.cases:
            overrides = [
                *SHAPE,
                *SCHEDULES[sched],
                *args.set,
                f"train.offload_modules=[{','.join(CASES[case])}]",
                *EXTRA.get(case, []),
            ]
            res = _run_case(overrides, args.steps, run_dir)
            if ref is None:
                ref = res
            pairs = [
                (a, b)
                for step_a, step_b in zip(ref["grads"], res["grads"], strict=True)
                for a, b in zip(step_a, step_b, strict=True)
            ]
            equal = all(torch.equal(a, b) for a, b in pairs)
            diff = [
                max(float((a - b).abs().max()) for a, b in zip(sa, sb, strict=True))
                for sa, sb in zip(ref["grads"], res["grads"], strict=True)
            ]
            step_time = torch.tensor([res["step_time_s"]], dtype=torch.float64)
            dist.all_reduce(step_time, op=dist.ReduceOp.MAX)  # the pipeline's step
            if res is ref:
                ref_time = float(step_time)
            row = {
                "schedule": sched,
                "case": case,
                "offload_modules": CASES[case],
                "rank": dist.get_rank(),
                "peak_resident_bytes": [p[0] for p in res["peaks"]],
                "peak_offloaded_bytes": [p[1] for p in res["peaks"]],
                "ratio": [p[0] / r[0] for p, r in zip(res["peaks"], ref["peaks"], strict=True)],
                "grads_bit_identical": equal,
                "max_abs_grad_diff": diff,
                "step_time_s": float(step_time),
                "step_time_ratio": float(step_time) / ref_time,
                "device_max_allocated": res["device_max_allocated"],
            }
            rows.append(row)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        all_rows = [r for rank_rows in gathered for r in rank_rows]
        if args.json:
            Path(args.json).write_text(json.dumps(all_rows, indent=1))
        _print(all_rows)
    from titan_core.parallel.initialize import shutdown

    shutdown()


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'schedule':<14}{'case':<30}{'stage':>6}{'resident peak KiB':>19}"
        f"{'ratio first':>12}{'ratio steady':>13}{'offloaded KiB':>14}{'grads ==':>9}"
        f"{'step time ratio':>16}"
    )
    for r in sorted(rows, key=lambda r: (r["schedule"], list(CASES).index(r["case"]), r["rank"])):
        print(
            f"{r['schedule']:<14}{r['case']:<30}{r['rank']:>6}"
            f"{r['peak_resident_bytes'][-1] / 1024:>19.1f}{r['ratio'][0]:>12.3f}"
            f"{r['ratio'][-1]:>13.3f}{r['peak_offloaded_bytes'][-1] / 1024:>14.1f}"
            f"{'yes' if r['grads_bit_identical'] else 'NO':>9}{r['step_time_ratio']:>16.2f}"
        )
        if r["device_max_allocated"]:
            print(f"{'':<50}device max_memory_allocated {r['device_max_allocated']}")


# ---- launcher -------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per case (median)")
    ap.add_argument(
        "--cases", default=",".join(CASES), help=f"from {list(CASES)}; first is the reference"
    )
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"from {list(SCHEDULES)}")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides (key=value)")
    args = ap.parse_args(argv)
    args.cases = args.cases.split(",")
    args.schedules = args.schedules.split(",")
    for name, known in (("cases", CASES), ("schedules", SCHEDULES)):
        bad = [x for x in getattr(args, name) if x not in known]
        if bad:
            ap.error(f"unknown --{name} {bad}; choose from {list(known)}")
    if args.cases[0] != "off":
        args.cases.insert(0, "off")
    if args.worker:
        _worker(args)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as run_dir:  # shared by both ranks (the data cache)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
            __file__, "--worker", "--run-dir", run_dir, "--steps", str(args.steps),
            "--cases", ",".join(args.cases), "--schedules", ",".join(args.schedules),
            *(["--json", args.json] if args.json else []),
            *(["--set", *args.set] if args.set else []),
        ]  # fmt: skip
        return subprocess.run(cmd, env=env, cwd=REPO).returncode


if __name__ == "__main__":
    raise SystemExit(main())
