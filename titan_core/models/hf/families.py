"""HF <-> megatron-core name tables, one small table per model family.

Names on the megatron side are the local layer spec's (``get_gpt_layer_local_spec``), relative
to ``decoder.layers.<i>.``; HF names are relative to ``model.layers.<i>.``. A rule's kind says
how tensors combine:

- ``copy``: one tensor, same layout;
- ``qkv``: HF q/k/v -> megatron's fused ``linear_qkv`` (per query group: its q heads, k, v);
- ``gate_up``: HF gate/up -> megatron's fused swiglu ``linear_fc1`` ([gate; up]).

Expert rules carry ``{e}`` (the global expert index) in both names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["copy", "qkv", "gate_up"]


@dataclass(frozen=True)
class Rule:
    kind: Kind
    hf: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]
    layer: dict[str, Rule]
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    #: config.json keys whose value must be falsy (features the mapping does not cover).
    unsupported: tuple[str, ...] = field(default=())


def _attn(bias: bool, qk_norm: bool) -> dict[str, Rule]:
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    rules = {
        "input_layernorm.weight": Rule("copy", ("input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": Rule("qkv", tuple(f"{n}.weight" for n in qkv)),
        "self_attention.linear_proj.weight": Rule("copy", ("self_attn.o_proj.weight",)),
        "pre_mlp_layernorm.weight": Rule("copy", ("post_attention_layernorm.weight",)),
    }
    if bias:
        rules["self_attention.linear_qkv.bias"] = Rule("qkv", tuple(f"{n}.bias" for n in qkv))
    if qk_norm:
        rules["self_attention.q_layernorm.weight"] = Rule("copy", ("self_attn.q_norm.weight",))
        rules["self_attention.k_layernorm.weight"] = Rule("copy", ("self_attn.k_norm.weight",))
    return rules


_DENSE_MLP = {
    "mlp.linear_fc1.weight": Rule("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": Rule("copy", ("mlp.down_proj.weight",)),
}

_MOE_MLP = {
    "mlp.router.weight": Rule("copy", ("mlp.gate.weight",)),
    "mlp.experts.local_experts.{e}.linear_fc1.weight": Rule(
        "gate_up", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")
    ),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": Rule(
        "copy", ("mlp.experts.{e}.down_proj.weight",)
    ),
}

LLAMA = Family(
    ("llama",),
    {**_attn(False, False), **_DENSE_MLP},
    unsupported=("attention_bias", "mlp_bias"),
)
QWEN2 = Family(("qwen2",), {**_attn(True, False), **_DENSE_MLP}, qkv_bias=True)
QWEN3 = Family(
    ("qwen3",), {**_attn(False, True), **_DENSE_MLP}, qk_norm=True, unsupported=("attention_bias",)
)
QWEN3_MOE = Family(
    ("qwen3_moe",),
    {**_attn(False, True), **_MOE_MLP},
    qk_norm=True,
    moe=True,
    unsupported=("attention_bias", "mlp_only_layers"),
)

FAMILIES: dict[str, Family] = {
    t: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE) for t in f.model_types
}

#: Outside the layers (megatron name -> HF name); ``vocab`` rows are padded on the megatron side.
EMBEDDING = ("embedding.word_embeddings.weight", "model.embed_tokens.weight")
FINAL_NORM = ("decoder.final_layernorm.weight", "model.norm.weight")
OUTPUT = ("output_layer.weight", "lm_head.weight")
