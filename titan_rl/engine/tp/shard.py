"""Megatron-style tensor-parallel shards of a loaded HF causal LM (the engine's ``--tp-size``).

Each TP rank keeps, on its loaded model instance (no library module is patched):

- attention: ``q_proj``/``k_proj``/``v_proj`` (and biases) split by heads (column parallel),
  ``o_proj`` split by input columns (row parallel), its partial outputs summed over the group
  before the bias; ``q_norm``/``k_norm`` act per head and stay whole. With more ranks than KV
  heads each KV head is replicated on ``tp / kv_heads`` ranks (as SGLang does). HF attention
  infers the head count from the projection's output, so only ``num_key_value_groups`` (the
  query heads per KV head on a rank) is set on the instance.
- dense MLP: ``gate_proj``/``up_proj`` column parallel, ``down_proj`` row parallel + all-reduce.
- MoE block: experts (fused 3-D ``gate_up_proj``/``down_proj`` or a list of expert MLPs) and
  shared experts split along the intermediate dim, their partial outputs summed by one
  all-reduce of the block's output; the router stays whole, so every rank routes alike.
- embeddings, norms and ``lm_head``: whole (the logits are the same on every rank).

A :class:`Split` says how a checkpoint tensor maps to a rank's shard, so weight updates carry
full HF tensors and each rank keeps its part (:meth:`Split.take`), and a full tensor can be
put back together from the ranks' shards (:meth:`Split.join`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: sums a rank's partial output over the TP group; returns the sum (maybe the input, summed
#: in place)
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Split:
    """A tensor split along ``dim`` into ``parts`` chunks, per each of ``groups`` equal blocks
    (fused ``[gate; up]`` is 2 blocks). Rank ``r`` of ``size`` keeps chunk ``r * parts // size``
    of every block: ``parts < size`` replicates each chunk on ``size // parts`` ranks."""

    dim: int
    parts: int
    groups: int = 1

    def index(self, rank: int, size: int) -> int:
        return rank * self.parts // size

    def take(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full`` (a view when there is one block)."""
        i = self.index(rank, size)
        blocks = full.chunk(self.groups, self.dim) if self.groups > 1 else (full,)
        pieces = [b.chunk(self.parts, self.dim)[i] for b in blocks]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (``shards[r]`` is rank r's)."""
        size = len(shards)
        first = {}
        for r in range(size):
            first.setdefault(self.index(r, size), shards[r])
        chunks = [first[i].chunk(self.groups, self.dim) for i in range(self.parts)]
        return torch.cat([c[g] for g in range(self.groups) for c in chunks], self.dim)


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over a slice of the input features: the partial products are summed over
    the TP group (``reduce``), then the (whole) bias is added once. Same parameter names."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce: Reduce) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def check_tp(config: Any, tp_size: int) -> None:
    """Whether ``config``'s model splits ``tp_size`` ways (ValueError naming --tp-size)."""
    if tp_size < 1:
        raise ValueError(f"--tp-size {tp_size} must be at least 1")
    if tp_size == 1:
        return
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % tp_size:
        raise ValueError(
            f"--tp-size {tp_size} does not divide the model's {heads} attention heads; use a "
            "--tp-size that divides num_attention_heads"
        )
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"--tp-size {tp_size} and the model's {kv} key/value heads do not divide one "
            "another; use a --tp-size that divides num_key_value_heads or is a multiple of it"
        )
    sizes = {
        "intermediate_size": getattr(config, "intermediate_size", None),
        "moe_intermediate_size": getattr(config, "moe_intermediate_size", None),
        "shared_expert_intermediate_size": getattr(config, "shared_expert_intermediate_size", None),
    }
    for key, value in sizes.items():
        if value and int(value) % tp_size:
            raise ValueError(
                f"--tp-size {tp_size} does not divide the model's {key} ({value}); use a "
                f"--tp-size that divides it"
            )


def shard_model(model: nn.Module, rank: int, size: int, reduce: Reduce) -> dict[str, Split]:
    """Keep rank ``rank``'s shard of every parallel layer of ``model`` (in place).

    Returns the :class:`Split` of every sharded tensor by its state-dict name (the per-expert
    names of fused experts are added by :func:`expert_splits`). ``reduce`` sums over the group.
    """
    if size == 1:
        return {}
    config = model.config
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    splits: dict[str, Split] = {}
    moe_blocks: list[str] = []  # their MLPs (experts, shared experts) are sharded with them
    for prefix, module in list(model.named_modules()):
        if any(prefix.startswith(f"{b}.") for b in moe_blocks):
            continue
        if all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            _shard_attention(module, prefix, heads, kv, rank, size, reduce, splits)
        elif hasattr(module, "experts") and hasattr(module, "gate"):
            _shard_moe(module, prefix, rank, size, reduce, splits)
            moe_blocks.append(prefix)
        elif all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            _shard_mlp(module, prefix, rank, size, reduce, splits)
    return splits


def _linear(module: nn.Module, name: str) -> nn.Linear:
    lin = getattr(module, name)
    if type(lin) is not nn.Linear:
        raise ValueError(
            f"{type(module).__name__}.{name} is a {type(lin).__name__}, not nn.Linear; "
            "--tp-size > 1 cannot shard it (use --tp-size 1)"
        )
    return lin


def _column(lin: nn.Linear, split: Split, rank: int, size: int) -> None:
    """Keep the rank's output rows of ``lin`` (and of its bias)."""
    lin.weight = nn.Parameter(split.take(lin.weight.data, rank, size).clone(), False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(split.take(lin.bias.data, rank, size).clone(), False)
    lin.out_features = lin.weight.shape[0]


def _row(
    parent: nn.Module, name: str, rank: int, size: int, reduce: Reduce | None
) -> RowParallelLinear | nn.Linear:
    """Keep the rank's input columns of ``parent.name``; ``reduce``: sum its output over the
    group (None: a later reduction of the enclosing block sums it; then no bias is allowed)."""
    lin = _linear(parent, name)
    weight = Split(1, size).take(lin.weight.data, rank, size).clone()
    if reduce is None:
        if lin.bias is not None:
            raise ValueError(
                f"{name} has a bias inside an MoE block; --tp-size > 1 cannot shard it"
            )
        lin.weight = nn.Parameter(weight, False)
        lin.in_features = weight.shape[1]
        return lin
    bias = None if lin.bias is None else lin.bias.data
    row = RowParallelLinear(weight, bias, reduce)
    setattr(parent, name, row)
    return row


def _shard_attention(
    attn: nn.Module,
    prefix: str,
    heads: int,
    kv: int,
    rank: int,
    size: int,
    reduce: Reduce,
    splits: dict[str, Split],
) -> None:
    q, kv_parts = Split(0, size), Split(0, min(kv, size))
    for name, split in (("q_proj", q), ("k_proj", kv_parts), ("v_proj", kv_parts)):
        _column(_linear(attn, name), split, rank, size)
        splits[f"{prefix}.{name}.weight"] = split
        if getattr(attn, name).bias is not None:
            splits[f"{prefix}.{name}.bias"] = split
    _row(attn, "o_proj", rank, size, reduce)
    splits[f"{prefix}.o_proj.weight"] = Split(1, size)
    # query heads per KV head on this rank (HF's eager/sdpa attention repeat KV heads by it)
    attn.num_key_value_groups = (heads // size) // max(kv // size, 1)


def _shard_mlp(
    mlp: nn.Module,
    prefix: str,
    rank: int,
    size: int,
    reduce: Reduce | None,
    splits: dict[str, Split],
) -> None:
    for name in ("gate_proj", "up_proj"):
        _column(_linear(mlp, name), Split(0, size), rank, size)
        splits[f"{prefix}.{name}.weight"] = Split(0, size)
        if getattr(mlp, name).bias is not None:
            splits[f"{prefix}.{name}.bias"] = Split(0, size)
    _row(mlp, "down_proj", rank, size, reduce)
    splits[f"{prefix}.down_proj.weight"] = Split(1, size)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = mlp.gate_proj.out_features


def _shard_moe(
    block: nn.Module,
    prefix: str,
    rank: int,
    size: int,
    reduce: Reduce,
    splits: dict[str, Split],
) -> None:
    experts = block.experts
    if isinstance(experts, nn.ModuleList):
        for e, expert in enumerate(experts):
            _shard_mlp(expert, f"{prefix}.experts.{e}", rank, size, None, splits)
    else:
        _shard_fused_experts(experts, f"{prefix}.experts", rank, size, splits)
    for name in ("shared_expert", "shared_experts"):
        shared = getattr(block, name, None)
        if isinstance(shared, nn.Module):
            _shard_mlp(shared, f"{prefix}.{name}", rank, size, None, splits)

    def all_reduce_output(module: nn.Module, args: Any, output: Any) -> Any:
        # one reduction for the experts and the shared experts (their sum is linear in each)
        if isinstance(output, tuple):
            return (reduce(output[0]), *output[1:])
        return reduce(output)

    block.register_forward_hook(all_reduce_output)


def _shard_fused_experts(
    experts: nn.Module, prefix: str, rank: int, size: int, splits: dict[str, Split]
) -> None:
    """transformers >= 5's 3-D experts: ``gate_up_proj`` [E, 2I, H] ([gate; up] rows) and
    ``down_proj`` [E, H, I]; transposed: [E, H, 2I] and [E, I, H]."""
    if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True):
        raise ValueError("experts with biases or without a gate cannot be sharded; --tp-size 1")
    if not getattr(experts, "is_concatenated", True):
        raise ValueError("interleaved gate/up experts cannot be sharded; use --tp-size 1")
    transposed = bool(getattr(experts, "is_transposed", False))
    gate_up = Split(2 if transposed else 1, size, groups=2)
    down = Split(1 if transposed else 2, size)
    for name, split in (("gate_up_proj", gate_up), ("down_proj", down)):
        param = getattr(experts, name)
        setattr(experts, name, nn.Parameter(split.take(param.data, rank, size).clone(), False))
        splits[f"{prefix}.{name}"] = split
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim //= size


def expert_splits(fused: dict[str, str], size: int) -> dict[str, Split]:
    """The splits of per-expert checkpoint names (HF layout: gate/up ``[I, H]``, down
    ``[H, I]``) that map onto fused expert tensors (``fused``: per-expert -> fused name)."""
    if size == 1:
        return {}
    out = {}
    for name in fused:
        part = name.rsplit(".", 2)[-2]
        out[name] = Split(1, size) if part == "down_proj" else Split(0, size)
    return out


__all__ = ["RowParallelLinear", "Split", "check_tp", "expert_splits", "shard_model"]
