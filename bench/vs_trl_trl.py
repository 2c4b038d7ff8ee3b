"""TRL's side of bench/vs_trl.py: Hugging Face TRL's ``GRPOTrainer`` on the bench's tiny
model and arithmetic task, run as a user with one CPU machine would run it.

    python bench/vs_trl_trl.py --model DIR --data train.jsonl --max-len M --steps N --out OUT

Writes OUT (json): the wall clock at start-up, at ``on_train_begin`` and at each
``on_step_end`` (a ``TrainerCallback``), and each step's logged metrics (logging every
step), which carry the completion lengths the bench checks against Titan's. Needs trl
(``.venv/bin/pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
import time

START = time.time()  # before the imports: they are part of the command's start-up
#: the samples each reward call scored: one call per generation (per optimizer step here)
REWARD_SAMPLES: list[int] = []


def first_line_match(completions: list, label: list, **_: object) -> list[float]:
    """Titan's ``reward.type: exact_match``: the response's first line, stripped, equals the
    stripped label (titan_rl/rewards/scorer.py). Conversational completions: one assistant
    message each."""
    REWARD_SAMPLES.append(len(completions))
    out = []
    for c, want in zip(completions, label, strict=True):
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(float(text.split("\n")[0].strip() == str(want).strip()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory (weights + tokenizer)")
    ap.add_argument("--data", required=True, help="jsonl with prompt and label columns")
    ap.add_argument("--max-len", type=int, required=True, help="max_completion_length")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per optimizer step")
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work-dir", required=True, help="output_dir (nothing is saved there)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    stamps: dict = {"start": START, "steps": [], "logs": []}

    class Stamps(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):  # noqa: ANN001, ANN201
            stamps["train_begin"] = time.time()
            print("vs_trl: train begins", flush=True)  # the bench times this line from launch

        def on_step_end(self, a, state, control, **kw):  # noqa: ANN001, ANN201
            stamps["steps"].append([state.global_step, time.time()])

        def on_log(self, a, state, control, logs=None, **kw):  # noqa: ANN001, ANN201
            stamps["logs"].append({"step": state.global_step, **(logs or {})})

    ds = load_dataset("json", data_files=args.data, split="train")
    # a chat model's prompts: TRL applies the tokenizer's chat template to conversational ones
    ds = ds.map(lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}]})
    batch = args.prompts * args.samples
    cfg = GRPOConfig(
        output_dir=args.work_dir,
        use_cpu=True,
        bf16=False,  # fp32, as Titan's trainer and engine run this model
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is True; a tiny model does not need it
        per_device_train_batch_size=batch,  # completions, not prompts
        gradient_accumulation_steps=1,
        generation_batch_size=batch,  # one generation per optimizer step
        num_generations=args.samples,
        max_completion_length=args.max_len,
        num_iterations=1,
        beta=0.0,  # no KL, no reference model
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=1,
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=first_line_match,
        args=cfg,
        train_dataset=ds,
        callbacks=[Stamps()],
    )
    stamps["eos_token_ids"] = list(trainer.eos_token_ids)
    stamps["init_done"] = time.time()
    trainer.train()
    stamps["global_step"] = trainer.state.global_step
    stamps["reward_samples"] = REWARD_SAMPLES
    stamps["end"] = time.time()
    with open(args.out, "w") as f:
        json.dump(stamps, f)


if __name__ == "__main__":
    main()
