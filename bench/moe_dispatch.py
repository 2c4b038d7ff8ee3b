"""MoE dispatch throughput per dispatcher at EP=1 and EP=2, and expert load before and after
aux-loss-free balancing (expert bias) on a skewed batch.

    python bench/moe_dispatch.py                       # ~1-2 min on 2 CPU cores
    python bench/moe_dispatch.py --tokens 4096 --iters 20 --balance-steps 60

Two processes (gloo on CPU, the accelerator's backend elsewhere) run one megatron-core MoE
layer (``titan_core.models.moe_layer``: router, token dispatcher, SequentialMLP experts;
``--experts`` experts, top-``--topk``, SwiGLU) forward and backward on ``--tokens`` random
tokens per rank, per dispatcher and EP size. EP=1: every rank holds all experts (the
dispatch is a local permutation); EP=2: each holds half and tokens cross ranks (all-to-all,
or all-gather + reduce-scatter). Tokens/s = both ranks' tokens / the slower rank's time,
median of ``--iters`` iterations after ``--warmup``; ratios are to alltoall at EP=1. ``flex``
(DeepEP) is listed as skipped, with the reason, where DeepEP is not there.

Balancing: sigmoid router with the expert bias on (``model.moe_router_enable_expert_bias``,
``--rate`` per step), fed a stream of tokens shifted toward the router rows of ``--topk``
experts (``--skew``), EP=1 on both ranks; each step is a forward (the router counts its
tokens) and megatron's bias update (what ``finalize_model_grads`` runs after every training
step). Load = max/mean tokens per expert over both ranks, the ``moe/load_imbalance`` metric
of metrics.jsonl; "off" runs the same stream with the bias update skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_core.config import load_config  # noqa: E402
from titan_core.config.pretrain import PretrainConfig  # noqa: E402

CONFIG = str(REPO / "examples" / "pretrain_tiny_moe.yaml")
DISPATCHERS = ("alltoall", "allgather", "flex")


def _layer_overrides(a: argparse.Namespace, dispatcher: str, ep: int) -> list[str]:
    return [
        f"model.hidden_size={a.hidden}", "model.num_attention_heads=4",
        f"model.moe_ffn_hidden_size={a.ffn}", f"model.num_moe_experts={a.experts}",
        f"model.moe_router_topk={a.topk}", f"model.moe_token_dispatcher_type={dispatcher}",
        f"parallel.expert_model_parallel_size={ep}", "train.lr_warmup_iters=1",
    ]  # fmt: skip


def _start(overrides: list[str]):  # noqa: ANN202
    """(Re)create megatron's groups for this layout; the config and the accelerator."""
    from megatron.core import parallel_state

    from titan_core.parallel.initialize import initialize

    cfg = load_config(PretrainConfig, CONFIG, overrides)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    accel, _, _ = initialize(cfg)
    return cfg, accel


def _flex_skip_reason(ep: int) -> str | None:
    from titan_core.accelerator import get_accelerator

    accel = get_accelerator()
    if ep == 1:
        return "megatron-core's flex dispatcher needs EP x TP > 1"
    if accel.device_type == "cpu":
        return "DeepEP runs on GPUs only (accelerator: cpu)"
    if not accel.supports("deep_ep"):
        return f"DeepEP (deep_ep) is not installed (accelerator: {accel.name})"
    return None


def throughput(a: argparse.Namespace, ep: int) -> list[dict[str, Any]]:
    """Tokens/s of one MoE layer's forward + backward per dispatcher, both ranks together.
    The dispatchers' layers take turns iteration by iteration, so a load change on the host
    falls on all of them alike."""
    from megatron.core.pipeline_parallel.schedules import custom_backward

    from titan_core.accelerator import megatron_scope
    from titan_core.models.moe_layer import build_moe_layer

    rows, layers = [], {}
    for dispatcher in DISPATCHERS:
        if dispatcher == "flex" and (reason := _flex_skip_reason(ep)):
            rows.append({"dispatcher": dispatcher, "ep": ep, "skipped": reason})
            continue
        if not layers:  # the groups of this EP size, once
            _, accel = _start(_layer_overrides(a, dispatcher, ep))
        cfg = load_config(PretrainConfig, CONFIG, _layer_overrides(a, dispatcher, ep))
        layers[dispatcher] = build_moe_layer(cfg, accel)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(a.tokens, 1, a.hidden, generator=g).to(accel.device())
    x.requires_grad_(True)
    times: dict[str, list[float]] = {d: [] for d in layers}
    for i in range(a.warmup + a.iters):
        for dispatcher, layer in layers.items():
            dist.barrier()
            accel.synchronize()
            start = time.perf_counter()
            with megatron_scope():
                out, _ = layer(x)
                # the autograd engine directly, as megatron's schedules call it: Tensor.backward
                # would run the backward outside megatron_scope's CPU device mode
                custom_backward(out.float().square().mean(), None)
            accel.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
            if i >= a.warmup:
                times[dispatcher].append(float(elapsed))
    for dispatcher, ts in times.items():
        step = statistics.median(ts)
        tokens_per_s = dist.get_world_size() * a.tokens / step
        rows.append(
            {"dispatcher": dispatcher, "ep": ep, "tokens_per_s": tokens_per_s, "step_s": step}
        )
    return sorted(rows, key=lambda r: DISPATCHERS.index(r["dispatcher"]))


def balancing(a: argparse.Namespace, update: bool) -> list[float]:
    """Load max/mean each step on the skewed stream, with or without the bias update."""
    from titan_core.accelerator import megatron_scope
    from titan_core.models.moe_layer import build_moe_layer, skewed_tokens, update_expert_bias
    from titan_core.training.moe_load import MoELoadTracker

    cfg, accel = _start([
        *_layer_overrides(a, "alltoall", 1), "model.moe_router_score_function=sigmoid",
        "model.moe_router_enable_expert_bias=true", f"model.moe_router_bias_update_rate={a.rate}",
        "model.moe_router_load_balancing_type=none",
    ])  # fmt: skip
    layer = build_moe_layer(cfg, accel)
    dist.broadcast(layer.router.weight.data, src=0)  # one router, as after DP's first sync
    tracker = MoELoadTracker([layer], 1, a.experts, accel.device())
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    ratios = []
    for _ in range(a.balance_steps):
        tracker.reset()
        with megatron_scope(), torch.enable_grad():
            layer(skewed_tokens(layer.router, a.tokens, a.skew, a.topk, g))
            if update:
                update_expert_bias(layer.router)
            else:
                layer.router.local_tokens_per_expert.zero_()
        ratios.append(tracker.collect()["moe/load_imbalance_max"])
    tracker.remove()
    return ratios


def worker(a: argparse.Namespace) -> None:
    from titan_core.parallel.initialize import shutdown

    rows = [row for ep in (1, 2) for row in throughput(a, ep)]
    balance = {"on": balancing(a, update=True), "off": balancing(a, update=False)}
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps({"rows": rows, "balance": balance}))
    shutdown()


def report(result: dict[str, Any], a: argparse.Namespace) -> None:
    rows = result["rows"]
    base = next(r for r in rows if r["dispatcher"] == "alltoall" and r["ep"] == 1)
    print(
        f"MoE layer fwd+bwd, {a.experts} experts top-{a.topk}, hidden {a.hidden}, expert ffn "
        f"{a.ffn}, {a.tokens} tokens/rank, 2 ranks (median of {a.iters})"
    )
    print(f"{'dispatcher':<11}{'EP':>3}{'tokens/s':>12}{'s/iter':>9}{'vs alltoall EP=1':>18}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['dispatcher']:<11}{r['ep']:>3}  skipped: {r['skipped']}")
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        print(
            f"{r['dispatcher']:<11}{r['ep']:>3}{r['tokens_per_s']:>12,.0f}{r['step_s']:>9.3f}"
            f"{ratio:>17.2f}x"
        )
    on, off = result["balance"]["on"], result["balance"]["off"]
    tail = min(10, len(on))
    print(
        f"\nExpert load max/mean (1.0 = even; {a.experts / a.topk:.1f} = all on {a.topk}), skewed "
        f"stream (skew {a.skew}), {a.balance_steps} steps, bias rate {a.rate}:"
    )
    print(
        f"  bias off: step 1 {off[0]:.2f}, mean of last {tail} {statistics.mean(off[-tail:]):.2f}"
    )
    print(f"  bias on:  step 1 {on[0]:.2f}, mean of last {tail} {statistics.mean(on[-tail:]):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512, help="expert ffn hidden size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--balance-steps", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.01, help="expert bias update rate")
    ap.add_argument("--skew", type=float, default=3.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--standalone", __file__, "--worker", "--out", str(out),
            *[f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
              if k not in ("worker", "out")],
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("[rank0]")]
            tail = "\n".join(errors[-30:]) or proc.stderr[-4000:]
            sys.exit(f"bench workers failed ({proc.returncode}):\n{tail}")
        report(json.loads(out.read_text()), a)


if __name__ == "__main__":
    main()
