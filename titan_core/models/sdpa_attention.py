"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for the layer
specs that run without Transformer Engine (CPU, and any device without TE).

megatron-core's local spec computes attention unfused (``DotProductAttention``): it writes
the ``[b * heads, sq, sk]`` scores into a buffer, masks and softmaxes them in separate ops,
copies the probabilities around the dropout and multiplies again, and autograd keeps each
of those tensors for backward. On a CPU that is most of a small model's training step (the
vs-TRL bench's 2-layer model: ~40% of it). PyTorch's fused kernel computes the same
attention without materialising the scores. :class:`SDPAttention` is ``DotProductAttention``
(same constructor, scale, dropout and checkpoint layout) whose forward takes the fused path
for what the GPT layers ask of it (causal self-attention or no mask, plain softmax, no
sliding window); any other case runs megatron's own forward. :func:`with_sdpa_attention`
puts it in a layer or block spec.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec


class SDPAttention(DotProductAttention):
    """``DotProductAttention`` through the fused SDPA kernel where it computes the same."""

    def _fused(self, attention_mask: Any, attention_bias: Any, packed_seq_params: Any) -> bool:
        softmax = self.scale_mask_softmax
        return (
            attention_mask is None
            and attention_bias is None
            and packed_seq_params is None
            and self.softmax_offset is None
            and softmax.window_size is None
            and self.attn_mask_type in (AttnMaskType.causal, AttnMaskType.no_mask)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``query`` ``[sq, b, heads, d]``, ``key`` / ``value`` ``[sk, b, groups, d]`` ->
        ``[sq, b, heads * d]``, as ``DotProductAttention.forward``."""
        if not self._fused(attention_mask, attention_bias, packed_seq_params):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias,
                packed_seq_params,
            )  # fmt: skip
        sq, b = query.shape[0], query.shape[1]
        # the scale megatron applies: alpha on the scores, times the softmax's own coefficient
        # (apply_query_key_layer_scaling divides one by the layer number and the other undoes it)
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        causal = self.attn_mask_type == AttnMaskType.causal and sq > 1
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        dropout = self.attention_dropout.p if self.training else 0.0
        # dropout draws from the model-parallel RNG, as megatron's forward does
        fork = dropout and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=causal, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )  # fmt: skip
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def with_sdpa_attention(spec: Any) -> Any:
    """``spec`` (a layer's ``ModuleSpec``, or a block's ``TransformerBlockSubmodules``) with
    its ``DotProductAttention`` core attention replaced by :class:`SDPAttention`."""
    layers = getattr(spec, "layer_specs", None)
    if layers is not None:
        return dataclasses.replace(spec, layer_specs=[with_sdpa_attention(s) for s in layers])
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    inner = getattr(attention, "submodules", None)
    if not isinstance(attention, ModuleSpec) or inner is None:
        return spec
    if getattr(inner, "core_attention", None) is not DotProductAttention:
        return spec
    inner = dataclasses.replace(inner, core_attention=SDPAttention)
    attention = dataclasses.replace(attention, submodules=inner)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )


__all__ = ["SDPAttention", "with_sdpa_attention"]
