"""Tiny random HF models of each mapped family (built from transformers config classes)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    if family == "llama":  # tied embeddings
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=True)
        return tf.LlamaForCausalLM(cfg)
    if family == "qwen2":  # qkv bias
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=False)
        model = tf.Qwen2ForCausalLM(cfg)
    elif family == "qwen3":  # qk norm, head_dim != hidden / heads
        cfg = tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
        )  # fmt: skip
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(family)
    # Random norms and biases (HF initialises them to 1 / 0, which would hide mapping bugs).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def save_case(family: str, root: Path) -> tuple[Path, Path]:
    """Save the model and its logits on a fixed batch; returns (model_dir, logits_file)."""
    model = build_hf_model(family).eval()
    d = root / family
    model.save_pretrained(d)
    ids = torch.randint(
        0, COMMON["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.save({"ids": ids, "logits": logits}, d / "probe.pt")
    return d, d / "probe.pt"


def hf_policy_overrides(model_dir: str | Path, seq_length: int) -> list[str]:
    """GRPO config overrides that load the HF model in ``model_dir`` as the policy: its
    ``model.*`` keys read from its config.json, megatron-core's local transformer layers."""
    from titan_core.models.hf import model_config_from_hf

    model = model_config_from_hf(model_dir, seq_length=seq_length, transformer_impl="local")
    keys = model.model_dump(exclude_none=True).items()
    return [
        "policy.format=hf", f"policy.load={model_dir}",
        *(f"model.{k}={v}" for k, v in keys if not isinstance(v, list | dict)),
    ]  # fmt: skip
