"""One trainer rank of ``bench/weight_sync.py --trainer-layout`` (run under torchrun).

    torchrun --nproc-per-node 2 bench/weight_sync_worker.py --layout pp=2 --model-dir HF \
        --engines URL URL --transports tensor distributed --out result.json

Builds the megatron-core model at the layout from the HF checkpoint, then for each transport
syncs it into the engines ``--repeats`` times, perturbing the weights in place before each
sync (so every sync carries weights no engine has seen) with the parity check after each
(``sync.check_every=1``), and once before the first (``before``: the engines then serve other
weights, so it must fail). Trainer rank 0 writes, per transport, the fastest sync's metrics,
the bytes each rank sent in it, and the worst parity after any sync.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def trainer_chunks(model_dir: str, tp: int = 1, pp: int = 1, ep: int = 1,
                   vpp: int | None = None, seq_length: int = 64) -> list[Any]:  # fmt: skip
    """Start this rank (process groups) and build the model chunks of the HF checkpoint at
    ``model_dir`` at the layout, with its weights (local transformer spec)."""
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.models.gpt import (
        build_model_chunks,
        build_transformer_config,
        padded_vocab_size,
    )
    from titan_core.models.hf import HFBridge, model_config_from_hf
    from titan_core.parallel.initialize import initialize

    model = model_config_from_hf(model_dir, seq_length=seq_length, transformer_impl="local")
    cfg = PretrainConfig.model_validate(
        {
            "model": model.model_dump(),
            "parallel": {
                "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": pp,
                "expert_model_parallel_size": ep,
                "virtual_pipeline_model_parallel_size": vpp,
            },
            # data parallel = ep (see bench/weight_sync_layouts.py)
            "train": {"micro_batch_size": 1, "global_batch_size": ep, "lr_warmup_iters": 0},
        }
    )
    accel, _, _ = initialize(cfg)
    tf = build_transformer_config(cfg, accel)
    chunks = build_model_chunks(cfg, tf, padded_vocab_size(model.vocab_size, cfg), accel)
    HFBridge(model_dir).load(chunks, model_dir)
    return chunks


@torch.no_grad()
def perturb(chunks: list[Any], seed: int) -> None:
    """Seeded noise on every parameter, in place (as an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    for chunk in chunks:
        for p in chunk.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.dtype))


def sync_config(transport: str, bucket_bytes: int, disk_dir: str, agents: list[str]) -> Any:
    """The SyncConfig of a bench transport name (``tensor-direct``: the direct format)."""
    from titan_rl.sync import SyncConfig

    name = transport.removesuffix("-direct")
    settings = {
        "tensor": {"format": "direct" if transport == "tensor-direct" else "flattened_bucket"},
        "disk": {"dir": disk_dir},
        "distributed": {},
        "mooncake": {"agents": agents},
    }[name]
    return SyncConfig(
        transport=name, bucket_bytes=bucket_bytes, check_every=1, strict=False,
        **{name: settings},
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--engines", nargs="+", required=True)
    ap.add_argument("--transports", nargs="+", required=True)
    ap.add_argument("--bucket-bytes", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--agents", nargs="*", default=[])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch.distributed as dist
    from weight_sync_layouts import parse_layout

    from titan_core.parallel.initialize import shutdown
    from titan_rl.sync import WeightSync

    layout = parse_layout(a.layout)
    chunks = trainer_chunks(a.model_dir, layout.tp, layout.pp, layout.ep, layout.vpp)
    results = []
    for i, transport in enumerate(a.transports):
        cfg = sync_config(transport, a.bucket_bytes, a.disk_dir, a.agents)
        ws = WeightSync(cfg, a.engines, a.model_dir)
        best: dict[str, Any] = {}
        worst_parity, before = 0.0, float("nan")
        for j in range(a.repeats):
            perturb(chunks, seed=1000 * i + j + 1)
            if j == 0:  # the engines serve other weights now: the parity check can fail
                before = ws.check(chunks).get("sync/logprob_abs_diff_max", 0.0)
            m = ws.sync(chunks, step=j + 1, version=f"{layout}-{transport}-{j + 1}")
            rank_bytes: list[int | None] = [None] * dist.get_world_size()
            dist.all_gather_object(rank_bytes, ws.last_report.bytes)
            if dist.get_rank() != 0:
                continue
            worst_parity = max(worst_parity, m.get("sync/logprob_abs_diff_max", float("inf")))
            if not best or m["sync/time_s"] < best["metrics"]["sync/time_s"]:
                best = {"metrics": m, "rank_bytes": rank_bytes}
        ws.close()
        if dist.get_rank() == 0:
            best["metrics"]["sync/logprob_abs_diff_max"] = worst_parity
            results.append({"transport": transport, "before": before, **best})
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(results, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
