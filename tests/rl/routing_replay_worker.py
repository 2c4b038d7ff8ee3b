"""A real ``PolicyTrainer`` with ``algo.routing_replay`` on a tiny HF Qwen3-MoE, fed samples the
built-in engine generated (tokens, logprobs, routed experts; JSON from the test). Per rank,
writes the largest |trainer - engine| logprob over the response tokens and the routing
agreement: with the engine's weights, then with the trainer's routers perturbed (replayed,
then routing on their own), and the metrics of one policy update with replay.

``python tests/rl/routing_replay_worker.py --model-dir HF --samples S --run-dir D --out DIR
[--pp N] [--ep N]`` (one process, or several under torchrun)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch


def run(a: argparse.Namespace) -> dict[str, Any]:
    from tests.models.hf_cases import hf_policy_overrides
    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig
    from titan_rl.sample import Sample
    from titan_rl.trainer.batch import pack_samples
    from titan_rl.trainer.policy import PolicyTrainer
    from titan_rl.trainer.routing import moe_routers

    rows = json.loads(Path(a.samples).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = [
        *hf_policy_overrides(a.model_dir, seq_length=32), f"run.dir={a.run_dir}",
        f"rollout.prompts_per_step={len(rows) // 2}", "rollout.n_samples_per_prompt=2",
        "train.micro_batch_size=1", "train.ppo_steps=1", "algo.use_tis=false",
        "algo.routing_replay=true", "rollout.return_routed_experts=true",
        f"parallel.pipeline_model_parallel_size={a.pp}",
        f"parallel.expert_model_parallel_size={a.ep}",
    ]  # fmt: skip
    trainer = PolicyTrainer(load_config(GRPOConfig, None, overrides), world_size=world)
    samples = [
        Sample(group_index=i // 2, index=i, prompt="", label="", reward=float(i % 2),
               prompt_tokens=r["prompt"], response_tokens=r["response"],
               rollout_log_probs=r["logprobs"],
               rollout_routed_experts=torch.tensor(r["routed"], dtype=torch.int32))
        for i, r in enumerate(rows)
    ]  # fmt: skip
    batch = pack_samples(samples, pad_id=0)
    local = trainer._local_rows(batch)

    def measure() -> dict[str, float | None]:
        lp = trainer.logprobs(local, local=True)
        diff = None
        if lp is not None:  # last pipeline stage
            mask = local.response_mask.bool()
            diff = float((lp - local.rollout_logprobs)[mask].abs().max())
        return {"max_abs_diff": diff, "agreement": trainer.routing_agreement}

    out: dict[str, Any] = {"same_weights": measure()}
    # perturb the router rows of the experts the rollout never picked in a layer: the
    # replayed experts' logits (so their gates) stay as they were, while the router's own
    # top-k now picks the perturbed experts for many tokens
    routed = batch.routed_experts
    g = torch.Generator().manual_seed(a.seed)
    perturbed = 0
    with torch.no_grad():  # the same noise on every rank (routers are replicated)
        for chunk in trainer.model:
            for router in moe_routers(chunk):
                used = routed[:, :, router.layer_number - 1].flatten()
                unused = sorted(set(range(router.weight.shape[0])) - set(used.tolist()))
                noise = torch.randn((len(unused), router.weight.shape[1]), generator=g)
                router.weight[unused] += a.noise * noise.to(router.weight.dtype)
                perturbed += len(unused)
    out["perturbed_experts"] = perturbed
    out["perturbed_replay"] = measure()
    trainer.routing.replay = False  # the perturbed routers route on their own
    out["perturbed_free"] = measure()
    trainer.routing.replay = True
    metrics = trainer.train(local, local=True, step=1)
    out["train"] = {k: v for k, v in metrics.items() if k.startswith(("mismatch/", "train/"))}
    trainer.shutdown()
    return out


def main() -> None:
    from titan_core.accelerator.megatron_compat import import_megatron

    import_megatron()  # first, as the trainer and pretrain import it
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--samples", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=3.0)
    a = ap.parse_args()
    out = run(a)
    rank = int(os.environ.get("RANK", "0"))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
