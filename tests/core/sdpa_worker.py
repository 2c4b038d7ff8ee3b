"""One CPU process: a config's GPT built as Titan builds it (core attention through the fused
SDPA kernel) and the same weights in megatron-core's own local spec (``DotProductAttention``),
run forward and backward on one batch. Prints, as JSON, the two runs' largest logit and
gradient differences and the core attention classes each used.

``python -m tests.core.sdpa_worker key=value ...``
"""

from __future__ import annotations

import json
import sys

import torch


def _run(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, pos, None)
    # a loss that weighs every position and vocabulary entry differently
    weights = torch.linspace(-1.0, 1.0, logits.numel()).view_as(logits)
    (logits.float() * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _core_attention(model: torch.nn.Module) -> list[str]:
    return sorted(
        {type(x).__name__ for n, x in model.named_modules() if n.endswith("core_attention")}
    )


def main(overrides: list[str]) -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    from titan_core.accelerator import megatron_scope
    from titan_core.config.loader import apply_overrides
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.models.gpt import build_model_chunks, build_transformer_config
    from titan_core.parallel.initialize import initialize

    cfg = PretrainConfig.model_validate(apply_overrides({}, overrides))
    accel, _, _ = initialize(cfg)
    tf = build_transformer_config(cfg, accel)
    vocab = 256
    (titan,) = build_model_chunks(cfg, tf, vocab, accel)
    m = cfg.model
    with megatron_scope():
        if m.num_moe_experts and m.moe_layer_freq != 1:
            spec = get_gpt_decoder_block_spec(
                tf, use_transformer_engine=False, normalization=m.normalization
            )
        else:
            spec = get_gpt_layer_local_spec(
                num_experts=m.num_moe_experts, moe_grouped_gemm=m.moe_grouped_gemm,
                qk_layernorm=m.qk_layernorm, normalization=m.normalization,
            )  # fmt: skip
        megatron = GPTModel(
            config=tf, transformer_layer_spec=spec, vocab_size=vocab,
            max_sequence_length=m.max_position_embeddings or m.seq_length,
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type, rotary_base=int(m.rotary_base),
        )  # fmt: skip
        megatron.load_state_dict(titan.state_dict())
        tokens = torch.randint(
            0, vocab, (3, m.seq_length), generator=torch.Generator().manual_seed(0)
        )
        out: dict = {}
        for mode in ("train", "eval"):
            titan.train(mode == "train")
            megatron.train(mode == "train")
            ours, our_grads = _run(titan, tokens)
            ref, ref_grads = _run(megatron, tokens)
            out[mode] = {
                "logits": float((ours - ref).abs().max()),
                "logits_scale": float(ref.abs().max()),
                "grads": max(
                    float((our_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                    for n, g in ref_grads.items()
                ),
                "same_grads": sorted(our_grads) == sorted(ref_grads),
            }
    out["titan"], out["megatron"] = _core_attention(titan), _core_attention(megatron)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
