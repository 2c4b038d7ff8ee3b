"""Saves through slime's ``TitanTrainActor.save_model`` on a real trainer, in its own process
(one rank, gloo, CPU), then a release checkpoint laid out as slime's converter lays it out.

1. A tiny HF model as the policy, one policy update, then ``save_model(r)`` for rollouts
   0..3 with ``--save-retain-interval 2`` and ``--save-hf DIR/hf/rollout_{rollout_id}``.
2. The trainer's logits on a fixed batch (the reference the HF snapshots are compared to),
   and what Titan's resume reads back from the newest checkpoint.
3. slime's converter's procedure (``tools/convert_hf_to_torch_dist.py``): a weights-only
   save as iteration 1, the folder moved to ``release/``, the tracker set to ``release``;
   ``common.pt`` then made as Megatron-LM writes it (megatron-core's enum in ``args``, no
   Titan state). The model is zeroed, loaded from it, and its logits compared again.

Writes ``DIR/result.pt``. ``python tests/adapters/checkpoint_interop_worker.py --model-dir HF
--out DIR``
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tests.adapters.backend_worker import N_PROMPTS, N_SAMPLES, _samples

RETAIN = 2


def _logits(chunk: Any, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    from titan_core.accelerator import megatron_scope

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    chunk.eval()
    with torch.no_grad(), megatron_scope():
        out = chunk(ids, pos, attention_mask=None)
    chunk.train()
    return out[..., :vocab].float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)

    from adapters.common.backend import TitanBackend
    from adapters.slime.actor import TitanTrainActor
    from tests.models.hf_cases import COMMON, hf_policy_overrides
    from titan_core.checkpoint import RELEASE, damage, latest_iteration, load_checkpoint
    from titan_core.checkpoint.dist import TRACKER, iteration_dir, save_checkpoint, unwrap

    overrides = [
        *hf_policy_overrides(a.model_dir, seq_length=16),
        f"rollout.prompts_per_step={N_PROMPTS}", f"rollout.n_samples_per_prompt={N_SAMPLES}",
        "train.micro_batch_size=4", "train.lr=1e-2", "train.min_lr=1e-2", "train.clip_grad=0",
        "train.lr_warmup_iters=0", "train.lr_decay_style=constant",
        "parallel.use_distributed_optimizer=true", "train.ppo_steps=1", f"run.dir={out / 'run'}",
    ]  # fmt: skip
    ckpt = out / "ckpt"
    backend = TitanBackend(
        SimpleNamespace(titan_overrides=overrides, save=str(ckpt), save_retain_interval=RETAIN),
        world_size=1,
    )
    tokens, resp_lens, rewards = _samples()
    r = torch.tensor(rewards).view(N_PROMPTS, N_SAMPLES)
    r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
    backend.train({
        "tokens": tokens, "response_lengths": resp_lens,
        "loss_masks": [[1] * n for n in resp_lens], "rewards": r.flatten().tolist(),
    })  # fmt: skip

    actor = object.__new__(TitanTrainActor)  # slime's contract, without Ray
    actor.backend, actor.metrics = backend, {}
    actor.args = SimpleNamespace(
        save_hf=str(out / "hf" / "rollout_{rollout_id}"), hf_checkpoint=a.model_dir
    )
    for rollout_id in range(4):
        actor.save_model(rollout_id)
    kept = sorted(p.name for p in ckpt.iterdir() if p.is_dir())

    chunk = unwrap(backend.trainer.model[0])
    ids = torch.randint(
        0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3)
    )
    logits = _logits(chunk, ids, COMMON["vocab_size"])
    resumed = backend.trainer.resume(ckpt)

    # slime's converter: save_checkpoint(1, model, None, None, 0), iter_0000001 -> release/
    conv = out / "converted"
    save_checkpoint(conv, 1, backend.trainer.model, None, {})
    shutil.move(iteration_dir(conv, 1), conv / "release")
    (conv / TRACKER).write_text("release")
    common_pt = conv / "release" / "common.pt"
    common = torch.load(common_pt, weights_only=False)
    from megatron.core.transformer.enums import AttnBackend

    common["args"].attention_backend = AttnBackend.auto  # as Megatron-LM's validate_args sets
    common.pop("common")  # Megatron-LM writes no Titan state
    torch.save(common, common_pt)

    with torch.no_grad():
        for p in chunk.parameters():
            p.zero_()
    release_it = latest_iteration(conv)
    load_checkpoint(conv, release_it, backend.trainer.model, None)
    torch.save(
        {
            "kept": kept,
            "ids": ids,
            "logits": logits,
            "resumed_step": None if resumed is None else resumed.get("step"),
            "resumed_has_scheduler": bool(resumed and "scheduler" in resumed),
            "release_is_release": release_it == RELEASE,
            "release_damage": damage(conv / "release"),
            "release_logits": _logits(chunk, ids, COMMON["vocab_size"]),
            "release_resume": backend.trainer.resume(conv),
        },
        out / "result.pt",
    )
    backend.shutdown()


if __name__ == "__main__":
    main()
