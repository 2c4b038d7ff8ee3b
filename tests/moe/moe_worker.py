"""MoE checks that need megatron's process groups, in their own process.

python tests/moe/moe_worker.py --mode single|trainer --out result.json [--run-dir D]
torchrun --nproc-per-node 2 tests/moe/moe_worker.py --mode count_ep --out result.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TINY_MOE = str(REPO / "examples" / "pretrain_tiny_moe.yaml")
EXPERTS, TOPK = 8, 2
LAYER = [
    "model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64",
    "model.moe_ffn_hidden_size=32", f"model.num_moe_experts={EXPERTS}",
    f"model.moe_router_topk={TOPK}", "train.lr_warmup_iters=1",
]  # fmt: skip


def _config(overrides: list[str]):  # noqa: ANN202
    from titan_core.config import load_config
    from titan_core.config.pretrain import PretrainConfig

    return load_config(PretrainConfig, TINY_MOE, [*LAYER, *overrides])


def _setup(overrides: list[str]):  # noqa: ANN202
    from megatron.core import parallel_state

    from titan_core.accelerator import get_accelerator
    from titan_core.models.moe_layer import build_moe_layer
    from titan_core.parallel.initialize import initialize

    cfg = _config(overrides)
    if parallel_state.model_parallel_is_initialized():  # a second layer in this process
        accel = get_accelerator()
    else:
        accel, _, _ = initialize(cfg)
    return cfg, accel, build_moe_layer(cfg, accel)


def _hand_counts(router, x: torch.Tensor, capacity_factor: float | None) -> list[int]:  # noqa: ANN001
    """Softmax top-k by hand; with a capacity, each expert keeps at most its capacity."""
    logits = x.reshape(-1, x.shape[-1]).float() @ router.weight.detach().float().t()
    chosen = torch.topk(torch.softmax(logits, dim=-1), TOPK, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
    if capacity_factor is not None:
        capacity = math.ceil(logits.shape[0] * TOPK / EXPERTS * capacity_factor)
        counts = counts.clamp(max=capacity)
    return counts.tolist()


def count() -> dict[str, Any]:
    """The tracker's counts and ratio against a hand count (evaluation not counted), without
    and with capacity dropping (factor 1, padded to capacity), on the same weights."""
    from titan_core.accelerator import megatron_scope
    from titan_core.models.moe_layer import build_moe_layer
    from titan_core.training.moe_load import MoELoadTracker

    cfg, accel, plain = _setup([])
    capped_cfg = _config(
        ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"]
    )
    capped = build_moe_layer(capped_cfg, accel)
    capped.load_state_dict(plain.state_dict())
    x = torch.randn(24, 2, 32, generator=torch.Generator().manual_seed(7))
    out = {}
    for name, c, layer in (("plain", cfg, plain), ("capacity", capped_cfg, capped)):
        tracker = MoELoadTracker([layer], 1, EXPERTS, accel.device())
        with megatron_scope():
            layer(x)
            with torch.no_grad():
                layer(x)  # an eval forward: not counted
        out[name] = {
            "tracked": tracker.counts[0].tolist(),
            "hand": _hand_counts(layer.router, x, c.model.moe_expert_capacity_factor),
            "record": tracker.collect(),
        }
    return out


def count_ep() -> dict[str, Any]:
    """EP=2 on 2 ranks, each routing its own tokens: the collected ratio against a hand
    count over both ranks' tokens."""
    import torch.distributed as dist

    from titan_core.accelerator import megatron_scope
    from titan_core.training.moe_load import MoELoadTracker, load_imbalance

    _, accel, layer = _setup(["parallel.expert_model_parallel_size=2"])
    dist.broadcast(layer.router.weight.data, src=0)
    tracker = MoELoadTracker([layer], 1, EXPERTS, accel.device())
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(32, 2, 32, generator=g)
    with megatron_scope():
        layer(x)
    every = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(every, x)
    hand = torch.tensor(_hand_counts(layer.router, torch.cat(every), None))
    return {
        "local": tracker.counts[0].tolist(),
        "hand": hand.tolist(),
        "hand_ratio": float(load_imbalance(hand)),
        "record": tracker.collect(),
    }


def balance(steps: int, rate: float, skew: float) -> dict[str, Any]:
    """Aux-loss-free balancing on a skewed stream of tokens: the load ratio each step."""
    from titan_core.accelerator import megatron_scope
    from titan_core.models.moe_layer import skewed_tokens, update_expert_bias
    from titan_core.training.moe_load import MoELoadTracker

    _, accel, layer = _setup([
        "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
        f"model.moe_router_bias_update_rate={rate}", "model.moe_router_load_balancing_type=none",
    ])  # fmt: skip
    tracker = MoELoadTracker([layer], 1, EXPERTS, accel.device())
    g = torch.Generator().manual_seed(3)
    ratios = []
    for _ in range(steps):
        tracker.reset()
        with megatron_scope():
            layer(skewed_tokens(layer.router, 256, skew, TOPK, g))
            update_expert_bias(layer.router)
        ratios.append(tracker.collect()["moe/load_imbalance_max"])
    return {"ratios": ratios}


def trainer(run_dir: str, rate: float) -> dict[str, Any]:
    """The pretraining loop with the expert bias on: the routers' biases after each step."""
    from megatron.core.transformer.moe.router import TopKRouter

    from titan_core.checkpoint.dist import unwrap
    from titan_core.config import load_config
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.parallel.initialize import initialize, shutdown
    from titan_core.training.loop import Trainer

    cfg = load_config(
        PretrainConfig, TINY_MOE,
        ["model.seq_length=32", "model.max_position_embeddings=32", "model.num_layers=2",
         "train.micro_batch_size=4", "train.global_batch_size=8", "train.train_iters=3",
         "train.lr_warmup_iters=1", "checkpoint.save_interval=0", "data.num_samples=200",
         "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
         f"model.moe_router_bias_update_rate={rate}", f"run.dir={run_dir}"],
    )  # fmt: skip
    accel, _, dp = initialize(cfg)
    biases: list[list[list[float]]] = []
    try:
        t = Trainer(cfg, accel, dp)
        routers = [m for c in t.model for m in unwrap(c).modules() if isinstance(m, TopKRouter)]
        step = t.train_step

        def recorded(data):  # noqa: ANN001, ANN202
            out = step(data)
            biases.append([r.expert_bias.tolist() for r in routers])
            return out

        t.train_step = recorded
        t.train()
    finally:
        shutdown()
    return {"biases": biases, "num_routers": len(routers)}


def main() -> None:
    from titan_core.accelerator.megatron_compat import import_megatron

    import_megatron()  # first, as the trainer and pretrain import it
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["single", "count_ep", "trainer"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rate", type=float, default=0.02)
    ap.add_argument("--skew", type=float, default=3.0)
    a = ap.parse_args()
    if a.mode == "single":
        out = {"count": count(), "balance": balance(a.steps, a.rate, a.skew)}
    elif a.mode == "count_ep":
        out = count_ep()
    else:
        out = trainer(a.run_dir, a.rate)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
