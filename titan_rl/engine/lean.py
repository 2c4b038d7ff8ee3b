"""The engine's own forward (``--model-impl sglang``, SGLang's name for its native models):
the loaded HF model's modules and weights, called without transformers' per-call machinery.

A decode step of a small model on CPU is mostly Python: transformers' ``forward`` builds the
attention mask, dispatches the attention interface, wraps every output in a dataclass and
runs its decorators, for each of the step's few small matrix products. This forward calls the
same submodules (embedding, norms, projections, rotary embedding, MLP or MoE block, LM head)
in the same order, so their weights, tensor-parallel shards (titan_rl/engine/tp/shard.py) and
hooks (the routing recorder) are the ones the transformers path uses; it computes attention
itself: a decode step's one query per row as two batched products and a softmax, in float32
(as the SDPA kernel accumulates), a prompt with ``scaled_dot_product_attention``. Two parts
give the modules' values another way, bit for bit: the RMSNorms through torch's ``rms_norm``
(with the module's weight and epsilon), and the rotary ``cos, sin`` from a table the module
makes once (default RoPE), indexed by position.

It serves the decoder families the engine serves (Llama, Qwen2, Qwen3, Qwen3-MoE: pre-norm
layers, rotary attention with grouped KV heads, optional QK norms); :func:`lean_forward`
says why it cannot run any other model, which then runs on transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: the attributes the forward reads from each decoder layer and its attention module
_LAYER_PARTS = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
#: the served families' RMSNorms: ``weight * (x * rsqrt(mean(x**2) + eps))``, in float32
_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm"})
#: the rotary table's first size, in positions (it doubles as positions beyond it come)
_ROTARY_POSITIONS = 512


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; for a served family's RMSNorm without hooks, the same values from
    torch's ``rms_norm`` (a decode step's norms are a third of its ops: the module's five
    elementwise ops and its call cost more than the product they scale)."""
    if (
        type(module).__name__ not in _RMS_NORMS
        or module._forward_hooks
        or module._forward_pre_hooks
    ):
        return module(x)
    weight = module.weight
    eps = module.variance_epsilon
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # as the module: normalised in float32, rounded to the input's dtype, then scaled
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


class _RotaryTable:
    """The rotary embedding's ``cos, sin`` of every position up to the longest asked, made
    by the model's own module once and indexed per step (the module's ten ops per step
    become two). Only for the default RoPE, whose frequencies never change; other kinds
    (dynamic scaling) are asked of the module each time."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        self.rotary = rotary
        self.static = getattr(rotary, "rope_type", "default") == "default"
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, h: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.static:
            return self.rotary(h, position_ids)
        need = int(position_ids.max()) + 1
        table = self._tables.get(h.dtype)
        if table is None or table[0].shape[0] < need:
            size = max(need, _ROTARY_POSITIONS, 2 * table[0].shape[0] if table else 0)
            cos, sin = self.rotary(h[:1, :1], torch.arange(size).unsqueeze(0))
            table = self._tables[h.dtype] = (cos[0], sin[0])
        return table[0][position_ids], table[1][position_ids]


class LeanForward:
    """``forward(input_ids, cache, attention_mask, position_ids, logits_to_keep)`` -> logits,
    computing what the HF causal LM's forward with that cache computes."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = _RotaryTable(inner.rotary_emb)
        self.lm_head = model.lm_head
        self.layers = list(inner.layers)

    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: Any,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """The logits ``[B, keep, vocab]`` of the last ``logits_to_keep`` positions (0: all).

        ``cache``: the running batch's (a DynamicCache whose layers are updated in place);
        ``attention_mask`` ``[B, past + S]``: 0 at left padding (None: none);
        ``position_ids`` ``[B, S]`` (None: following the cache's length)."""
        bsz, seq = input_ids.shape
        past = cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + seq).unsqueeze(0).expand(bsz, seq)
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        bias = self._attention_bias(attention_mask, past, seq, h.dtype)
        for i, layer in enumerate(self.layers):
            residual = h
            x = _norm(layer.input_layernorm, h)
            h = residual + self._attention(layer.self_attn, x, cos, sin, cache.layers[i], bias)
            residual = h
            out = layer.mlp(_norm(layer.post_attention_layernorm, h))
            h = residual + (out[0] if isinstance(out, tuple) else out)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self.lm_head(_norm(self.norm, h))

    @staticmethod
    def _attention_bias(
        mask: torch.Tensor | None, past: int, seq: int, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """An additive mask ``[B or 1, 1, S, past + S]``: -inf at left padding and, for a
        prompt's positions, at later ones; None where nothing is masked (a decode step without
        padding, or a prompt with nothing cached, which SDPA masks causally itself)."""
        total = past + seq
        keep = None
        if mask is not None and not bool(mask.all()):
            keep = mask.bool()[:, None, None, :total]
        if seq > 1 and (past or keep is not None):
            causal = torch.ones(seq, total, dtype=torch.bool).tril(diagonal=past)[None, None]
            keep = causal if keep is None else keep & causal
        if keep is None:
            return None
        return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))

    @staticmethod
    def _attention(
        attn: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: Any,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        d = attn.head_dim
        q = attn.q_proj(x).view(bsz, seq, -1, d)
        k = attn.k_proj(x).view(bsz, seq, -1, d)
        v = attn.v_proj(x).view(bsz, seq, -1, d).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = layer_cache.update(k, v)
        heads, kv_heads = q.shape[1], keys.shape[1]
        if seq == 1:
            # [B, kv, group, d] @ [B, kv, d, T]: query head h reads KV head h // group; in
            # float32 (bf16 / fp16 weights too, as the SDPA kernel accumulates)
            qg = q.view(bsz, kv_heads, heads // kv_heads, d).float()
            scores = torch.matmul(qg, keys.float().transpose(2, 3)) * attn.scaling
            if bias is not None:
                scores = scores + bias[:, :, 0:1, :]
            probs = torch.softmax(scores, dim=-1)
            out = torch.matmul(probs, values.float()).to(q.dtype).reshape(bsz, 1, heads * d)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=bias, is_causal=bias is None,
                scale=attn.scaling, enable_gqa=heads != kv_heads,
            )  # fmt: skip
            out = out.transpose(1, 2).reshape(bsz, seq, heads * d)
        return attn.o_proj(out)


def lean_forward(model: torch.nn.Module) -> LeanForward | str:
    """The engine's own forward over ``model``, or why it cannot run it (a sentence)."""
    config = model.config
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "norm", "rotary_emb", "layers"):
        if getattr(inner, name, None) is None:
            return f"{type(model).__name__} has no model.{name}"
    if getattr(model, "lm_head", None) is None:
        return f"{type(model).__name__} has no lm_head"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    for i, layer in enumerate(inner.layers):
        missing = [p for p in _LAYER_PARTS if getattr(layer, p, None) is None]
        attn = getattr(layer, "self_attn", None)
        missing += [f"self_attn.{p}" for p in _ATTN_PARTS if getattr(attn, p, None) is None]
        if missing:
            return f"layer {i} ({type(layer).__name__}) has no {', '.join(missing)}"
        if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
            return f"layer {i} normalises only one of queries and keys"
        if getattr(attn, "sliding_window", None):
            return f"layer {i} uses sliding-window attention"
    return LeanForward(model)


__all__ = ["LeanForward", "lean_forward"]
