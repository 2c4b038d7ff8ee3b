"""Colocation frees the device: what a sleeping trainer still holds there.

Builds the adapters' trainer (``adapters.common.backend.TitanBackend``, Titan's Megatron
policy trainer) on a random HF Llama, runs one GRPO step (so the Adam state exists), then
``sleep()`` / ``wake_up()``, and prints per layout:

* the storage counter (``titan_core.training.device_memory``: bytes of the distinct storages
  the model(s), DDP's gradient / parameter buffers and the optimizer hold on the trainer's
  device) before and after the sleep, and their ratio (the anchor is the before-sleep figure
  of the same run);
* on a GPU, ``memory_allocated`` before and after as well;
* the sleep and wake times, and whether every tensor came back bit-identical.

Layouts: ``fp32`` (FP32Optimizer) and ``bf16`` (bf16 weights in DDP's parameter buffer,
distributed optimizer with fp32 main parameters, a reference model for the KL loss).

    python bench/colocate_memory.py [--hidden 256 --layers 4] [--layouts fp32 bf16] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = {
    "fp32": [],
    "bf16": [
        "train.bf16=true", "parallel.use_distributed_optimizer=true",
        "algo.use_kl_loss=true", "algo.kl_loss_coef=0.1",
    ],
}  # fmt: skip
PROMPTS, SAMPLES, SEQ = 2, 4, 64


def build_model(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=SEQ * 2,
        tie_word_embeddings=False,
    )  # fmt: skip
    tf.LlamaForCausalLM(cfg).save_pretrained(path)


def overrides(model_dir: Path, layout: str, run_dir: Path) -> list[str]:
    from titan_core.models.hf import model_config_from_hf

    model = model_config_from_hf(model_dir, seq_length=SEQ, transformer_impl="local")
    keys = model.model_dump(exclude_none=True).items()
    return [
        "policy.format=hf", f"policy.load={model_dir}",
        *(f"model.{k}={v}" for k, v in keys if not isinstance(v, list | dict)),
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.n_samples_per_prompt={SAMPLES}",
        "train.micro_batch_size=4", "train.lr=1e-3", "train.min_lr=1e-3",
        "train.lr_warmup_iters=0", "train.lr_decay_style=constant", "train.ppo_steps=1",
        f"run.dir={run_dir}", *LAYOUTS[layout],
    ]  # fmt: skip


def rollout(vocab: int) -> dict[str, Any]:
    """A rollout as slime hands a DP rank: random tokens, group-normalized rewards."""
    g = torch.Generator().manual_seed(0)
    n = PROMPTS * SAMPLES
    lens = [8 + int(torch.randint(0, SEQ // 2, (), generator=g)) for _ in range(n)]
    tokens = [torch.randint(1, vocab, (16 + r,), generator=g).tolist() for r in lens]
    r = torch.rand(PROMPTS, SAMPLES, generator=g)
    r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
    return {
        "tokens": tokens, "response_lengths": lens, "loss_masks": [[1] * x for x in lens],
        "rewards": r.flatten().tolist(),
    }  # fmt: skip


def measure(model_dir: Path, layout: str, vocab: int, run_dir: Path) -> dict[str, Any]:
    from adapters.common.backend import TitanBackend
    from titan_core.training.device_memory import trainer_tensors

    backend = TitanBackend(
        SimpleNamespace(titan_overrides=overrides(model_dir, layout, run_dir)), 1
    )
    try:
        t = backend.trainer
        accel = t.accel
        backend.train(rollout(vocab))
        tensors = trainer_tensors(t.model, t.optimizer, t.ref_model)
        copies = {(p, i): x.detach().clone() for p, xs in tensors.items() for i, x in enumerate(xs)}
        accel.synchronize()
        row: dict[str, Any] = {"layout": layout, "device": str(accel.device())}
        gpu = accel.device_type != "cpu"
        if gpu:
            row["allocated_before"] = accel.memory_allocated()
        figures = backend.sleep()
        row["bytes_before"] = int(figures["memory/device_bytes_before_sleep"])
        row["bytes_after"] = int(figures["memory/device_bytes_after_sleep"])
        row["ratio"] = row["bytes_after"] / row["bytes_before"]
        row["sleep_s"] = figures["time/train_sleep"]
        if gpu:
            row["allocated_after"] = accel.memory_allocated()
        start = time.perf_counter()
        backend.wake_up()
        row["wake_s"] = time.perf_counter() - start
        row["bytes_woken"] = backend.device_bytes()
        row["bit_identical"] = all(
            torch.equal(x, copies[(p, i)]) for p, xs in tensors.items() for i, x in enumerate(xs)
        )
        row["tensors"] = len(copies)
        return row
    finally:
        backend.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "hf"
        build_model(model_dir, a.hidden, a.layers, a.vocab)
        for layout in a.layouts:
            row = measure(model_dir, layout, a.vocab, Path(tmp) / f"run_{layout}")
            rows.append(row)
            line = (
                f"{layout:5s} {row['device']:6s} device bytes before sleep {row['bytes_before']:>11,d}"
                f" | after {row['bytes_after']:>9,d} | ratio {row['ratio']:.4f}"
                f" | sleep {row['sleep_s'] * 1e3:.0f} ms, wake {row['wake_s'] * 1e3:.0f} ms"
                f" | {row['tensors']} tensors bit-identical after wake: {row['bit_identical']}"
            )
            if "allocated_before" in row:
                line += f" | memory_allocated {row['allocated_before']:,d} -> {row['allocated_after']:,d}"
            print(line, flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
