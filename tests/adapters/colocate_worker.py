"""The colocation sleep of ``TitanBackend`` on a real trainer, in its own process (one rank,
gloo, CPU): for each layout, a run that never sleeps (the reference) and a run that sleeps
between its two policy updates, one after the other in this process.

Layouts: ``fp32`` (megatron's FP32Optimizer, parameters in their own storages) and ``bf16``
(bf16 weights in DDP's parameter buffer, the distributed optimizer's fp32 main parameters,
a reference model from ``algo.use_kl_loss``). Writes, per layout, the reference's and the
sleeper's second-step metrics and parameters, and what the sleeper saw to ``--out``.

``python tests/adapters/colocate_worker.py --model-dir HF --out F [--layouts fp32 bf16]``
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import torch

from tests.adapters.backend_worker import N_PROMPTS, N_SAMPLES, _samples

LAYOUTS = {
    "fp32": [],
    "bf16": [
        "train.bf16=true", "parallel.use_distributed_optimizer=true",
        "algo.use_kl_loss=true", "algo.kl_loss_coef=0.1",
    ],
}  # fmt: skip


def overrides(model_dir: str, layout: str) -> list[str]:
    from tests.models.hf_cases import hf_policy_overrides

    return [
        *hf_policy_overrides(model_dir, seq_length=16),
        f"rollout.prompts_per_step={N_PROMPTS}", f"rollout.n_samples_per_prompt={N_SAMPLES}",
        "train.micro_batch_size=4", "train.lr=1e-2", "train.min_lr=1e-2", "train.clip_grad=0",
        "train.lr_warmup_iters=0", "train.lr_decay_style=constant",
        "train.ppo_steps=1", "run.dir=/tmp/titan_colocate_worker", *LAYOUTS[layout],
    ]  # fmt: skip


def rollout(seed: int) -> dict[str, Any]:
    """One rollout as slime hands a DP rank (rewards group-normalized)."""
    tokens, resp_lens, rewards = _samples(seed)
    r = torch.tensor(rewards).view(N_PROMPTS, N_SAMPLES)
    r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
    return {
        "tokens": tokens, "response_lengths": resp_lens,
        "loss_masks": [[1] * n for n in resp_lens], "rewards": r.flatten().tolist(),
    }  # fmt: skip


def snapshot(backend: Any) -> dict[str, torch.Tensor]:
    """Copies of every parameter, DDP grad / param buffer, optimizer main parameter and
    optimizer state tensor, and the reference model's parameters, by name (the oracle:
    walked here independently of titan_core.training.device_memory)."""
    t = backend.trainer
    out: dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(t.model):
        for n, p in chunk.named_parameters():
            out[f"model{i}.{n}"] = p.detach().clone()
        for j, buf in enumerate(chunk.buffers + chunk.expert_parallel_buffers):
            out[f"model{i}.ddp{j}.grad_data"] = buf.grad_data.clone()
            if buf.param_data is not None:
                out[f"model{i}.ddp{j}.param_data"] = buf.param_data.clone()
    opts = getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]
    for k, opt in enumerate(opts):
        for g, group in enumerate(opt.optimizer.param_groups):
            for m, p in enumerate(group["params"]):
                out[f"opt{k}.group{g}.param{m}"] = p.detach().clone()
                for key, v in opt.optimizer.state[p].items():
                    if isinstance(v, torch.Tensor):
                        out[f"opt{k}.group{g}.param{m}.{key}"] = v.clone()
    for i, chunk in enumerate(t.ref_model or ()):
        for n, p in chunk.named_parameters():
            out[f"ref{i}.{n}"] = p.detach().clone()
    return out


def params(backend: Any) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().float().clone()
        for c in backend.trainer.model
        for n, p in c.named_parameters()
    }


def run(model_dir: str, layout: str, sleep: bool) -> dict[str, Any]:
    from adapters.common.backend import TitanBackend

    backend = TitanBackend(SimpleNamespace(titan_overrides=overrides(model_dir, layout)), 1)
    try:
        first = backend.train(rollout(0))
        seen: dict[str, Any] = {"first_loss": first.get("train/loss")}
        if sleep:
            before = snapshot(backend)
            seen["n_state"] = sum(1 for k in before if ".exp_avg" in k)
            seen["has_ref"] = backend.trainer.ref_model is not None
            accel = backend.trainer.accel
            on_gpu = accel.device_type != "cpu"
            seen["counter_before"] = backend.device_bytes()
            if on_gpu:
                accel.synchronize()
                seen["allocated_before"] = accel.memory_allocated()
            seen["sleep"] = backend.sleep()
            seen["counter_after"] = backend.device_bytes()
            if on_gpu:  # what the device has now, and the peak when an engine takes it
                seen["allocated_after"] = accel.memory_allocated()
                accel.accelerator_module.reset_peak_memory_stats()
                engine = torch.empty(
                    seen["counter_before"], dtype=torch.uint8, device=accel.device()
                )
                del engine
                seen["peak_with_engine"] = accel.max_memory_allocated()
            seen["second_sleep"] = backend.sleep()  # asleep already: nothing
            try:
                backend.train(rollout(1))
                seen["train_asleep"] = "no error"
            except RuntimeError as e:
                seen["train_asleep"] = str(e)
            with backend.awake(weights_only=True):  # what a weight sync gets
                seen["weights_awake_equal"] = all(
                    torch.equal(p, before[f"model{i}.{n}"])
                    for i, c in enumerate(backend.trainer.model)
                    for n, p in c.named_parameters()
                )
                seen["counter_weights_awake"] = backend.device_bytes()
            seen["counter_after_weights"] = backend.device_bytes()
            backend.wake_up()
            backend.wake_up()  # awake already: nothing
            seen["counter_woken"] = backend.device_bytes()
            after = snapshot(backend)
            seen["keys"] = sorted(before)
            seen["mismatch"] = [
                k for k in before if not (after[k].dtype == before[k].dtype and
                                          torch.equal(after[k], before[k]))
            ]  # fmt: skip
        second = backend.train(rollout(1))
        return {"seen": seen, "second": second, "params": params(backend)}
    finally:
        backend.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    a = ap.parse_args()
    out = {
        layout: {"plain": run(a.model_dir, layout, False), "sleep": run(a.model_dir, layout, True)}
        for layout in a.layouts
    }
    torch.save(out, a.out)


if __name__ == "__main__":
    main()
