"""Load HF checkpoints into megatron at a given layout, compare logits, export and compare.

Run as ``python tests/models/hf_worker.py --tp N --pp N --ep N out.json dir...`` (torchrun for
several processes). Rank 0 writes one result per directory to ``out.json``. With ``--plan
plan.json`` (``{name: {"tp": N, "pp": N, "ep": N, "dirs": [...]}}``) the layouts run one
after the other in the same processes (megatron's groups made again for each) and
``out.json`` holds ``{name: {directory: result}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def main() -> None:
    from titan_core.accelerator.megatron_compat import import_megatron

    import_megatron()  # first, as the trainer and pretrain import it
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--bucket-bytes", type=int, default=40_000)
    ap.add_argument("--plan", default=None)
    ap.add_argument("out")
    ap.add_argument("dirs", nargs="*")
    a = ap.parse_args()
    if a.plan is None:
        plan = {"": {"tp": a.tp, "pp": a.pp, "ep": a.ep, "dirs": a.dirs}}
    else:
        plan = json.loads(Path(a.plan).read_text())

    from megatron.core import parallel_state as ps

    out: dict[str, dict] = {}
    state: dict[str, Any] = {"accel": None, "layout": None}
    for name, job in plan.items():
        out[name] = {Path(d).name: _check(d, job, a.bucket_bytes, state) for d in job["dirs"]}
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(out if a.plan else out[""], indent=1))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _check(d: str, job: dict, bucket_bytes: int, state: dict[str, Any]) -> dict:
    """HF directory ``d`` loaded at ``job``'s layout: its logits and export against the
    files (``state``: the accelerator and the layout megatron's groups have now)."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from titan_core.accelerator import megatron_scope
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.models.gpt import (
        build_model_chunks,
        build_transformer_config,
        padded_vocab_size,
    )
    from titan_core.models.hf import HFBridge, model_config_from_hf
    from titan_core.parallel.initialize import initialize

    tp, pp = job["tp"], job["pp"]
    moe = "moe" in Path(d).name
    model = model_config_from_hf(d, seq_length=16, transformer_impl="local")
    par = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=job["ep"] if moe else 1,
    )
    cfg = PretrainConfig.model_validate(
        {
            "model": model.model_dump(),
            "parallel": par,
            "train": {"micro_batch_size": 1, "global_batch_size": 8, "lr_warmup_iters": 0},
        }
    )
    if state["accel"] is None:
        state["accel"], _, _ = initialize(cfg)
    elif state["layout"] != par:
        ps.destroy_model_parallel()
        initialize(cfg)
    state["layout"] = par
    accel = state["accel"]
    tf = build_transformer_config(cfg, accel)
    chunks = build_model_chunks(cfg, tf, padded_vocab_size(model.vocab_size, cfg), accel)
    bridge = HFBridge(d)
    bridge.load(chunks, d)
    res: dict = {}
    if pp == 1:
        probe = torch.load(Path(d) / "probe.pt")
        ids = probe["ids"]
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        with torch.no_grad(), megatron_scope():  # a call into megatron-core
            logits = chunks[0].eval()(ids, pos, attention_mask=None)
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        logits = logits[..., : model.vocab_size]
        res["logit_max_abs_diff"] = (logits - probe["logits"]).abs().max().item()
    buckets = list(bridge.export(chunks, bucket_bytes=bucket_bytes))
    if dist.get_rank() == 0:
        ref = load_file(str(Path(d) / "model.safetensors"))
        got = {}
        for b in buckets:
            got.update(b)
        res["oversized_buckets"] = sum(
            1
            for b in buckets
            if len(b) > 1 and sum(t.numel() * t.element_size() for _, t in b) > bucket_bytes
        )
        res["num_buckets"] = len(buckets)
        res["missing"] = sorted(set(ref) - set(got))
        res["extra"] = sorted(set(got) - set(ref))
        res["unequal"] = sorted(
            n for n in set(ref) & set(got)
            if ref[n].dtype != got[n].dtype or not torch.equal(ref[n], got[n])
        )  # fmt: skip
    else:
        res["buckets_on_non_dst"] = len(buckets)
    return res


if __name__ == "__main__":
    sys.exit(main())
