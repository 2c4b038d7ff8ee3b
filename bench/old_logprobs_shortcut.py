"""Time of one policy update (``time/train_compute``) with the old logprobs taken from the
update's own forward (train.ppo_steps=1, the default: no separate no-grad forward) against the
anchor, a separate forward for them (``algo.recompute_old_logprobs=true``), measured in
the same process on the default example's policy and batch shape.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/old_logprobs_shortcut.py [--steps 12]
        [--config examples/math.yaml] [key=value ...]

(the thread settings of the GRPO job's trainer on a small host: titan_rl/placement.py)

One trainer, the two modes alternating step by step on batches of the example's shape
(``rollout.prompts_per_step`` x ``n_samples_per_prompt`` rows of the base's prompt length
plus up to ``rollout.max_response_len`` response tokens); the first step of each mode is
warm-up. Pretrains the example's base first if it is missing, as the main job does.
Expected: the anchor is a no-grad forward plus the update (a forward and a backward, about
three forwards' work), so the shortcut takes about 0.75 of it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

WARMUP = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="steps per mode, warm-up included")
    ap.add_argument("--config", default=str(REPO / "examples/math.yaml"))
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args()

    from titan_core.config import load_config
    from titan_rl.base_policy import ensure_base_policy
    from titan_rl.config import GRPOConfig
    from titan_rl.sample import Sample
    from titan_rl.trainer.batch import pack_samples
    from titan_rl.trainer.policy import PolicyTrainer

    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["train.ppo_steps=1", f"run.dir={tmp}", *args.overrides]
        cfg = load_config(GRPOConfig, Path(args.config), overrides)
        ensure_base_policy(cfg.policy)
        trainer = PolicyTrainer(cfg)
        r = cfg.rollout
        prompt_len = cfg.model.seq_length - r.max_response_len
        g = torch.Generator().manual_seed(0)
        vocab = trainer.sampled_vocab

        def batch():  # noqa: ANN202
            samples = [
                Sample(group_index=i // r.n_samples_per_prompt, index=i, prompt="", label="",
                       reward=float(torch.rand(1, generator=g) < 0.5),
                       prompt_tokens=torch.randint(1, vocab, (prompt_len,), generator=g).tolist(),
                       response_tokens=torch.randint(
                           1, vocab, (int(torch.randint(1, r.max_response_len + 1, (1,),
                                                        generator=g)),), generator=g).tolist())
                for i in range(r.prompts_per_step * r.n_samples_per_prompt)
            ]  # fmt: skip
            b = pack_samples(samples, trainer.tokenizer.eod)
            b.rollout_logprobs = -torch.rand(b.response_mask.shape, generator=g) * b.response_mask
            return b

        times: dict[str, list[float]] = {"recompute": [], "shortcut": []}
        for _ in range(args.steps):
            for mode in times:
                trainer.cfg.algo = trainer.cfg.algo.model_copy(
                    update={"recompute_old_logprobs": mode == "recompute"}
                )
                times[mode].append(trainer.train(batch(), step=1)["time/train_compute"])
        trainer.shutdown()
    mean = {m: statistics.mean(t[WARMUP:]) for m, t in times.items()}
    print(f"policy: {cfg.policy.load}, batch {r.prompts_per_step * r.n_samples_per_prompt} rows "
          f"x {cfg.model.seq_length} tokens, micro batch {cfg.train.micro_batch_size}, "
          f"{args.steps - WARMUP} steps per mode after {WARMUP} warm-up")  # fmt: skip
    for m, t in times.items():
        print(f"{m:>9}: mean {mean[m]:.3f} s, median {statistics.median(t[WARMUP:]):.3f} s "
              f"per update ({', '.join(f'{x:.3f}' for x in t)})")  # fmt: skip
    median = {m: statistics.median(t[WARMUP:]) for m, t in times.items()}
    print(f"shortcut / recompute (anchor): {mean['shortcut'] / mean['recompute']:.3f} of the "
          f"mean, {median['shortcut'] / median['recompute']:.3f} of the median")  # fmt: skip


if __name__ == "__main__":
    main()
