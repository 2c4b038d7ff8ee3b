"""A real ``PolicyTrainer`` (tiny dense HF Llama, gloo) trained on one batch for a few
chained steps, each with other ``algo`` switches (``CASES``), with
``algo.recompute_old_logprobs`` as given: per step, the decision of
``old_logprobs_forward_reason``, the schedules ``train()`` ran (whose model, forward-only or
not), the step metrics, the gradients and the updated parameters, per rank (torch.save).

``python tests/rl/old_logprobs_worker.py --model-dir HF --run-dir D --out DIR --recompute 0|1
[--pp N] [--moe] [--recompute-layers N]`` (one process, or several under torchrun: the rest of
the ranks are DP). ``--moe``: an MoE model (tiny Qwen3-MoE, 4 experts, top 2) with routing
replay of random rollout routings; ``--recompute-layers``: megatron's full activation
recompute of the first N layers (its routers run again in the backward).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import torch

#: response lengths (long and short rows: the microbatches are sorted and cut)
RESPONSE_LENGTHS = [3, 17, 5, 2, 9, 4, 12, 6]
PROMPT_LENGTHS = [4, 7, 5, 9, 4, 6, 5, 8]
#: (name, algo switches) in the order they are trained; the first three keep the update's
#: forward as the old policy, the last two need the old logprobs before it
CASES: list[tuple[str, dict[str, Any]]] = [
    ("tis", {"use_tis": True}),
    ("icepop", {"use_tis": False, "use_icepop": True}),
    ("seq_tis", {"use_icepop": False, "use_tis": True, "tis_level": "geometric",
                 "loss_agg_mode": "seq_mean_token_mean", "advantage_estimator": "gspo"}),
    ("kl_in_reward", {"loss_agg_mode": "token_mean", "advantage_estimator": "grpo",
                      "use_kl_in_reward": True, "kl_in_reward_coef": 0.1}),
    ("mis", {"use_kl_in_reward": False, "kl_in_reward_coef": 0.0, "use_rs": True,
             "rs_upper_bound": 1.5}),
]  # fmt: skip
SHORTCUT_CASES = ("tis", "icepop", "seq_tis")


def run(a: argparse.Namespace) -> dict[str, Any]:
    from tests.models.hf_cases import hf_policy_overrides
    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig
    from titan_rl.sample import Sample
    from titan_rl.trainer.batch import pack_samples
    from titan_rl.trainer.policy import PolicyTrainer, old_logprobs_forward_reason

    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = [
        *hf_policy_overrides(a.model_dir, seq_length=32), f"run.dir={a.run_dir}",
        "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2",
        "train.micro_batch_size=2", "train.lr=1e-3",
        "train.min_lr=1e-3", "train.ppo_steps=1", "algo.use_kl_loss=true", "algo.kl_loss_coef=0.05",
        "algo.entropy_coef=0.01", f"algo.recompute_old_logprobs={bool(a.recompute)}",
        f"parallel.pipeline_model_parallel_size={a.pp}",
    ]  # fmt: skip
    if a.moe:
        overrides += ["algo.routing_replay=true", "rollout.return_routed_experts=true"]
    if a.recompute_layers:
        overrides += ["train.recompute_granularity=full", "train.recompute_method=block",
                      f"train.recompute_num_layers={a.recompute_layers}"]  # fmt: skip
    trainer = PolicyTrainer(load_config(GRPOConfig, None, overrides), world_size=world)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(group_index=i // 2, index=i, prompt="", label="", reward=float(i % 3 == 0),
               prompt_tokens=torch.randint(1, 290, (p,), generator=g).tolist(),
               response_tokens=torch.randint(1, 290, (r,), generator=g).tolist())
        for i, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True))
    ]  # fmt: skip
    if a.moe:  # the rollout's experts: 2 distinct of 4 per token and layer
        layers = trainer.cfg.model.num_layers
        for s in samples:
            n = len(s.tokens) - 1
            pick = torch.rand((n, layers, 4), generator=g).argsort(-1)[..., :2]
            s.rollout_routed_experts = pick.to(torch.int32)
    batch = pack_samples(samples, trainer.tokenizer.eod)

    runs: list[tuple[str, bool]] = []  # the schedules train() ran
    schedule = trainer._run

    def counted(model, fields, plan, loss_fn, forward_only):  # noqa: ANN001, ANN202
        runs.append(("policy" if model is trainer.model else "reference", forward_only))
        return schedule(model, fields, plan, loss_fn, forward_only)

    trainer._run = counted
    out: dict[str, Any] = {}
    for name, algo in CASES:
        trainer.cfg.algo = trainer.cfg.algo.model_copy(update=algo)
        # the engine's logprobs: about the random policy's (log 1/vocab), some far off
        noise = 0.4 * torch.randn(batch.response_mask.shape, generator=g)
        batch.rollout_logprobs = (-math.log(300) + noise) * batch.response_mask
        runs.clear()
        metrics = trainer.train(batch, step=1)
        out[name] = {
            "reason": old_logprobs_forward_reason(
                trainer.cfg, trainer.tf, trainer._local_rows(batch)
            ),
            "runs": list(runs),
            "metrics": {k: v for k, v in metrics.items() if not k.startswith("time/")},
            "grads": [p.main_grad.detach().clone() for c in trainer.model for p in c.parameters()],
            "params": [p.detach().clone() for c in trainer.model for p in c.parameters()],
        }
    trainer.shutdown()
    return out


def main() -> None:
    from titan_core.accelerator.megatron_compat import import_megatron

    import_megatron()  # first, as the trainer and pretrain import it
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recompute", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--recompute-layers", type=int, default=0)
    a = ap.parse_args()
    out = run(a)
    rank = int(os.environ.get("RANK", "0"))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    torch.save(out, Path(a.out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
