"""A real ``PolicyTrainer`` (tiny HF Llama, one rank, gloo) trained on a batch whose rollout
logprobs sit a known ``delta`` below the trainer's; writes the step metrics as JSON, once with
every correction off, with MIS and IcePop on, and with sequence-level MIS; and the advantages.

``python tests/algo/mismatch_worker.py --model-dir HF --run-dir D --out F``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

#: per response token: |delta| = 1 is outside [0.5, 2] (ratio e or 1/e), the rest inside
DELTAS = [[0.0, 0.1, 1.0], [-0.1, -1.0, 0.05], [0.2, 0.0, -0.2], [1.0, 0.3, -0.3]]


def run(model_dir: str, run_dir: str) -> dict[str, Any]:
    from tests.models.hf_cases import hf_policy_overrides
    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig
    from titan_rl.sample import Sample
    from titan_rl.trainer.batch import pack_samples
    from titan_rl.trainer.policy import PolicyTrainer

    overrides = [
        *hf_policy_overrides(model_dir, seq_length=16), f"run.dir={run_dir}",
        "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "train.micro_batch_size=2", "train.lr=1e-3", "train.min_lr=1e-3", "train.ppo_steps=1",
        "algo.use_tis=false",
    ]  # fmt: skip
    trainer = PolicyTrainer(load_config(GRPOConfig, None, overrides))
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(group_index=i // 2, index=i, prompt="", label="", reward=float(i % 2),
               prompt_tokens=torch.randint(1, 250, (4,), generator=g).tolist(),
               response_tokens=torch.randint(1, 250, (3,), generator=g).tolist())
        for i in range(4)
    ]  # fmt: skip
    batch = pack_samples(samples, trainer.tokenizer.eod)
    delta = torch.zeros_like(batch.response_mask)
    delta[batch.response_mask.bool()] = torch.tensor(DELTAS).flatten()

    out: dict[str, Any] = {}
    for name, algo in [
        ("off", {}),
        ("mis_icepop", {"use_rs": True, "use_icepop": True, "icepop_alpha": 0.5}),
        # geometric means of the rows' ratios: 1.44, 0.70, 1, 1.40: only row 2 stays
        ("seq_mis", {"use_icepop": False, "rs_level": "geometric", "rs_lower_bound": 0.8,
                     "rs_upper_bound": 1.2, "loss_agg_mode": "seq_mean_token_mean"}),
    ]:  # fmt: skip
        trainer.cfg.algo = trainer.cfg.algo.model_copy(update=algo)
        old = trainer.logprobs(batch)  # what train() computes as the old policy
        batch.rollout_logprobs = (old - delta) * batch.response_mask
        out[name] = trainer.train(batch, step=1)
    from titan_rl.algo import compute_advantages

    adv = compute_advantages(batch.rewards, 2, batch.response_mask, trainer.cfg.algo)
    out["advantages"] = adv[batch.response_mask.bool()].tolist()  # in DELTAS' order
    trainer.shutdown()
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
