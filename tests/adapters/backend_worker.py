"""One GRPO policy update of a tiny model, two ways, in its own process (one rank, gloo):

``titan``: ``PolicyTrainer.train(batch)`` as ``titan_rl.grpo`` calls it (advantages and old
logprobs computed inside); ``adapter``: ``adapters.common.backend.TitanBackend.train`` on the
same samples handed as a slime DP rank's rollout data (rewards group-normalized by the
rollout side, as slime's manager does). Writes the parameters before and after to ``--out``.

``python tests/adapters/backend_worker.py --mode titan|adapter --model-dir HF --out F``
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

N_PROMPTS, N_SAMPLES, PROMPT_LEN = 2, 4, 5


def _samples(seed: int = 0) -> tuple[list[list[int]], list[int], list[float]]:
    g = torch.Generator().manual_seed(seed)
    tokens, resp_lens, rewards = [], [], []
    for i in range(N_PROMPTS * N_SAMPLES):
        r = 2 + i % 5
        tokens.append(torch.randint(1, 250, (PROMPT_LEN + r,), generator=g).tolist())
        resp_lens.append(r)
        rewards.append(float(torch.rand((), generator=g) > 0.5) + 0.1 * i)
    return tokens, resp_lens, rewards


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["titan", "adapter"], required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from tests.models.hf_cases import hf_policy_overrides

    overrides = [
        *hf_policy_overrides(a.model_dir, seq_length=16),
        f"rollout.prompts_per_step={N_PROMPTS}", f"rollout.n_samples_per_prompt={N_SAMPLES}",
        "train.micro_batch_size=4", "train.lr=1e-2", "train.min_lr=1e-2", "train.clip_grad=0",
        "train.lr_warmup_iters=0", "train.lr_decay_style=constant",
        "train.ppo_steps=1", "run.dir=/tmp/titan_backend_worker",
    ]  # fmt: skip
    tokens, resp_lens, rewards = _samples()
    if a.mode == "titan":
        from titan_core.config import load_config
        from titan_rl.config import GRPOConfig
        from titan_rl.sample import Sample
        from titan_rl.trainer.batch import pack_samples
        from titan_rl.trainer.policy import PolicyTrainer

        trainer = PolicyTrainer(load_config(GRPOConfig, None, overrides))
        before = _params(trainer.model)
        samples = [
            Sample(group_index=i // N_SAMPLES, index=i, prompt="", label="",
                   prompt_tokens=t[: len(t) - r], response_tokens=t[len(t) - r :], reward=w)
            for i, (t, r, w) in enumerate(zip(tokens, resp_lens, rewards, strict=True))
        ]  # fmt: skip
        trainer.train(pack_samples(samples, trainer.tokenizer.eod))
        chunks = trainer.model
    else:
        from adapters.common.backend import TitanBackend

        r = torch.tensor(rewards).view(N_PROMPTS, N_SAMPLES)
        r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)  # slime's grpo
        backend = TitanBackend(SimpleNamespace(titan_overrides=overrides), world_size=1)
        before = _params(backend.trainer.model)
        backend.train({
            "tokens": tokens, "response_lengths": resp_lens,
            "loss_masks": [[1] * n for n in resp_lens], "rewards": r.flatten().tolist(),
        })  # fmt: skip
        chunks = backend.trainer.model
    torch.save({"before": before, "after": _params(chunks)}, a.out)


def _params(chunks: list) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for c in chunks for n, p in c.named_parameters()}


if __name__ == "__main__":
    main()
