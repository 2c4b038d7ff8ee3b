"""Non-finite faults injected into a real trainer, in its own process (one rank, gloo);
writes what each fault raised, and whether anything moved or reached the disk, as JSON.

``rl``: a tiny HF Llama as the policy of ``PolicyTrainer`` (as ``titan_rl.grpo`` builds it):
a NaN reward, a NaN gradient (a hook on one parameter), then a NaN parameter (a NaN loss);
``pretrain``: ``titan_core``'s pretraining ``Trainer`` on ``examples/pretrain_tiny.yaml`` with
a NaN parameter.

``python tests/rl/nonfinite_worker.py --mode rl|pretrain --model-dir HF --run-dir D --out F``
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def _params(model: list) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in model for n, p in c.named_parameters()}


def _same(before: dict[str, torch.Tensor], model: list) -> bool:
    """Every parameter as it was, bit for bit (a NaN equal to a NaN)."""
    after = _params(model)
    return all(torch.allclose(before[k], after[k], 0, 0, equal_nan=True) for k in before)


def _raised(fn: Any) -> str:
    from titan_core.training.finite import NonFiniteError

    try:
        fn()
    except NonFiniteError as e:
        return str(e)
    return ""


def _first_weight(model: list) -> torch.nn.Parameter:
    return next(p for c in model for n, p in c.named_parameters() if n.endswith("weight"))


def rl(model_dir: str, run_dir: str) -> dict[str, Any]:
    from tests.models.hf_cases import hf_policy_overrides
    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig
    from titan_rl.sample import Sample
    from titan_rl.trainer.batch import pack_samples
    from titan_rl.trainer.policy import PolicyTrainer

    overrides = [
        *hf_policy_overrides(model_dir, seq_length=16), f"run.dir={run_dir}",
        "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "train.micro_batch_size=2", "train.lr=1e-2", "train.min_lr=1e-2", "train.ppo_steps=2",
    ]  # fmt: skip
    trainer = PolicyTrainer(load_config(GRPOConfig, None, overrides))
    g = torch.Generator().manual_seed(0)

    def batch(rewards: list[float]) -> Any:
        samples = [
            Sample(group_index=i // 2, index=i, prompt="", label="", reward=r,
                   prompt_tokens=torch.randint(1, 250, (4,), generator=g).tolist(),
                   response_tokens=torch.randint(1, 250, (3,), generator=g).tolist())
            for i, r in enumerate(rewards)
        ]  # fmt: skip
        return pack_samples(samples, trainer.tokenizer.eod)

    out: dict[str, Any] = {}
    before = _params(trainer.model)
    out["nan_reward"] = _raised(lambda: trainer.train(batch([1.0, math.nan, 0.0, 1.0]), step=3))
    out["nan_reward_unchanged"] = _same(before, trainer.model)

    hook = _first_weight(trainer.model).register_hook(lambda grad: grad * math.nan)
    out["nan_grad"] = _raised(lambda: trainer.train(batch([1.0, 0.0, 0.0, 1.0]), step=4))
    out["nan_grad_unchanged"] = _same(before, trainer.model)
    hook.remove()

    metrics = trainer.train(batch([1.0, 0.0, 0.0, 1.0]), step=5)  # healthy: it trains
    out["healthy_loss"] = metrics["train/loss"]
    out["healthy_moved"] = not _same(before, trainer.model)

    with torch.no_grad():
        _first_weight(trainer.model).view(-1)[0] = math.nan
    poisoned = _params(trainer.model)
    out["nan_param"] = _raised(lambda: trainer.train(batch([1.0, 0.0, 0.0, 1.0]), step=6))
    out["nan_param_unchanged"] = _same(poisoned, trainer.model)
    out["save"] = _raised(lambda: trainer.save(6, {}))
    out["sync"] = _raised(lambda: trainer.check_finite("step 6: weight sync"))
    out["checkpoints"] = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("*"))
    trainer.shutdown()
    return out


def pretrain(run_dir: str) -> dict[str, Any]:
    from titan_core.config import load_config
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.parallel.initialize import initialize, shutdown
    from titan_core.training.loop import Trainer

    cfg = load_config(
        PretrainConfig, str(REPO / "examples/pretrain_tiny.yaml"),
        ["model.seq_length=32", "model.max_position_embeddings=32", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.train_iters=3", "train.lr_warmup_iters=0",
         "checkpoint.save_interval=1", "data.num_samples=200", f"run.dir={run_dir}"],
    )  # fmt: skip
    accel, _, dp = initialize(cfg)
    try:
        trainer = Trainer(cfg, accel, dp)
        with torch.no_grad():
            _first_weight(trainer.model).view(-1)[0] = math.nan
        out = {"train": _raised(trainer.train), "save": _raised(trainer.save)}
    finally:
        shutdown()
    out["checkpoints"] = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("*"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["rl", "pretrain"], required=True)
    ap.add_argument("--model-dir")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = rl(a.model_dir, a.run_dir) if a.mode == "rl" else pretrain(a.run_dir)
    Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
