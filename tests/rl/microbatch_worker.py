"""A real ``PolicyTrainer`` (tiny HF model, one rank, gloo) on a long-tailed batch, its rows
sorted into microbatches cut to their own longest row (the default), then again with every
microbatch at the batch's full length: per-token logprobs, step metrics and gradients of
both, and HF transformers' logprobs of each sample alone (the reference).

``python tests/rl/microbatch_worker.py --model-dir HF --run-dir D --out F``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

#: response lengths: most short, a long tail (what a step's generations look like)
RESPONSE_LENGTHS = [3, 41, 5, 2, 9, 4, 60, 6]
PROMPT_LENGTHS = [4, 7, 5, 9, 4, 6, 5, 8]


def _grads(trainer: Any) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for c in trainer.model for p in c.parameters()]


def run(model_dir: str, run_dir: str) -> dict[str, Any]:
    from tests.models.hf_cases import hf_policy_overrides
    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig
    from titan_rl.sample import Sample
    from titan_rl.trainer.batch import pack_samples
    from titan_rl.trainer.microbatch import plan_microbatches
    from titan_rl.trainer.policy import PolicyTrainer

    overrides = [
        *hf_policy_overrides(model_dir, seq_length=80), f"run.dir={run_dir}",
        "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2",
        "train.micro_batch_size=2", "train.lr=1e-3",
        "train.min_lr=1e-3", "train.ppo_steps=1",
        # the load-balancing loss counts every token a router sees, padding included: off,
        # so that the two layouts' gradients are the same sum
        "model.moe_aux_loss_coeff=0",
    ]  # fmt: skip
    trainer = PolicyTrainer(load_config(GRPOConfig, None, overrides))
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(group_index=i // 2, index=i, prompt="", label="", reward=float(i % 3 == 0),
               prompt_tokens=torch.randint(1, 250, (p,), generator=g).tolist(),
               response_tokens=torch.randint(1, 250, (r,), generator=g).tolist())
        for i, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True))
    ]  # fmt: skip
    batch = pack_samples(samples, trainer.tokenizer.eod)
    start = [p.detach().clone() for c in trainer.model for p in c.parameters()]
    out: dict[str, Any] = {"width": batch.tokens.shape[1]}
    trimmed_plan = trainer._plan
    for name in ("trimmed", "full"):
        if name == "full":  # the same trainer and weights, every microbatch at full length
            with torch.no_grad():
                params = [p for c in trainer.model for p in c.parameters()]
                for p, s in zip(params, start, strict=True):
                    p.copy_(s)
            trainer._plan = lambda fields, mask: plan_microbatches(
                mask.sum(1), 2, fields["tokens"].shape[1], trim=False
            )
        plan = trainer._plan({"tokens": batch.tokens}, batch.response_mask)
        lp = trainer.logprobs(batch)
        batch.rollout_logprobs = lp.clone() * batch.response_mask
        metrics = trainer.train(batch, step=1)
        out[name] = {
            "widths": list(plan.widths),
            "logprobs": (lp * batch.response_mask).tolist(),
            "metrics": {k: v for k, v in metrics.items() if k.startswith("train/")},
            "grads": [t.flatten().tolist() for t in _grads(trainer)],
        }
    trainer._plan = trimmed_plan
    trainer.shutdown()

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = torch.zeros_like(batch.response_mask)
    with torch.no_grad():
        for i, s in enumerate(samples):
            ids = torch.tensor([s.tokens])
            logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
            ref[i, : len(s.tokens) - 1] = logp.gather(1, ids[0, 1:, None])[:, 0]
    out["hf"] = (ref * batch.response_mask).tolist()
    out["mask"] = batch.response_mask.tolist()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Path(a.out).write_text(json.dumps(run(a.model_dir, a.run_dir)))


if __name__ == "__main__":
    main()
