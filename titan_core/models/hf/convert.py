"""Load HF safetensors checkpoints into megatron-core GPT models and export them back.

- :func:`model_config_from_hf` turns an HF ``config.json`` into Titan's ``model`` section.
- :func:`load_hf_weights` fills this rank's shards (TP / PP / VPP / EP) from an HF directory,
  reading each tensor lazily from the safetensors files.
- :func:`export_hf_weights` is a generator: every rank iterates it (it runs the gathers), and
  the destination rank receives full HF tensors in buckets of at most ``bucket_bytes``;
  tensors are gathered one parameter at a time (all-gather over TP / expert-TP, all-gather over
  EP, point-to-point from other pipeline stages), so the whole model never sits in memory.
  That is for writing one HF checkpoint; the weight sync uses :meth:`HFBridge.export_shard`,
  where each pipeline stage's and each EP rank's source rank yields its own part, and nothing
  crosses stages or EP ranks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_core.checkpoint.dist import unwrap
from titan_core.config.loader import ConfigError
from titan_core.config.pretrain import ModelConfig
from titan_core.models.hf.families import (
    EMBEDDING,
    FAMILIES,
    FINAL_NORM,
    OUTPUT,
    Family,
    Rule,
)

NamedTensors = list[tuple[str, torch.Tensor]]
#: where an export writes the HF tensor of a name and shape (see :meth:`HFBridge.export`)
Alloc = Callable[[str, torch.Size], torch.Tensor]


# ---- config ---------------------------------------------------------------------------------


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF model directory (or the file itself) as a dict."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"{f} does not exist; pass a local HF model directory with config.json")
    return json.loads(f.read_text())


def family_of(hf: dict[str, Any]) -> Family:
    mt = hf.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(
            f"HF model_type {mt!r} has no Megatron mapping; supported: {sorted(FAMILIES)}"
        )
    return FAMILIES[mt]


def _rope_theta(hf: dict[str, Any]) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise ConfigError(
            f"rope_type {kind!r} (RoPE scaling) is not mapped yet; only default RoPE is supported"
        )
    return float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def model_config_from_hf(source: str | Path | dict[str, Any], **overrides: Any) -> ModelConfig:
    """Titan's ``model`` section for an HF checkpoint directory, config.json or config dict.

    ``overrides`` win (e.g. ``seq_length``).
    """
    hf = source if isinstance(source, dict) else read_hf_config(source)
    fam = family_of(hf)
    for key in fam.unsupported:
        if hf.get(key):
            raise ConfigError(f"{hf['model_type']} with {key}={hf[key]!r} is not mapped yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r}: only silu (SwiGLU) is mapped")
    if hf.get("use_sliding_window"):
        raise ConfigError("sliding-window attention is not supported by the Megatron model")
    heads = int(hf["num_attention_heads"])
    values: dict[str, Any] = dict(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        kv_channels=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 4096),
        vocab_size=int(hf["vocab_size"]),
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf),
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias,
        qk_layernorm=fam.qk_norm,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
    )
    if fam.moe:
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        if not hf.get("norm_topk_prob", False):
            raise ConfigError(
                "norm_topk_prob=false (softmax over all experts, unnormalised top-k) is not "
                "mapped; megatron's default router renormalises over the top-k"
            )
        if int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ConfigError("decoder_sparse_step != 1 (dense layers between MoE) is not mapped")
        values.update(
            num_moe_experts=int(experts),
            moe_router_topk=int(hf["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
            moe_grouped_gemm=False,
        )
    # the default training length, within what the checkpoint's positions cover
    default_len = ModelConfig.model_fields["seq_length"].default
    values["seq_length"] = min(default_len, values["max_position_embeddings"])
    values.update(overrides)
    return ModelConfig.model_validate(values)


# ---- parallel layout -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Axis:
    """One parallel dimension as seen by this rank."""

    size: int = 1
    rank: int = 0
    group: Any = None


@dataclass(frozen=True)
class Layout:
    tp: _Axis
    etp: _Axis
    ep: _Axis
    pp: _Axis

    @staticmethod
    def current() -> Layout:
        """This rank's TP / expert-TP / EP / PP coordinates (all 1 without parallel_state)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return Layout(_Axis(), _Axis(), _Axis(), _Axis())
        return Layout(
            tp=_Axis(
                ps.get_tensor_model_parallel_world_size(),
                ps.get_tensor_model_parallel_rank(),
                ps.get_tensor_model_parallel_group(),
            ),
            etp=_Axis(
                ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group(check_initialized=False),
            ),
            ep=_Axis(
                ps.get_expert_model_parallel_world_size(),
                ps.get_expert_model_parallel_rank(),
                ps.get_expert_model_parallel_group(check_initialized=False),
            ),
            pp=_Axis(
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_rank(),
                ps.get_pipeline_model_parallel_group(),
            ),
        )


@dataclass(frozen=True)
class SendRole:
    """What this rank sends in :meth:`HFBridge.export_shard`.

    The non-expert ("dense") parameters of a pipeline stage go from its source rank (data- and
    context-parallel rank 0, TP rank 0), after a TP all-gather among the first replica's TP
    ranks. Experts go from the EP rank that owns them (expert-data-parallel rank 0,
    expert-TP rank 0), after an expert-TP all-gather; no EP gather. So the senders are, per
    stage, the EP ranks of the first expert-data-parallel replica.
    """

    #: this rank takes part in the TP gathers of the dense parameters
    dense_replica: bool = True
    #: ... and sends them (the stage's source rank)
    dense_sender: bool = True
    #: this rank takes part in the expert-TP gathers of its experts
    expert_replica: bool = True
    #: ... and sends them
    expert_sender: bool = True
    #: pipeline stage and EP rank: they name the sender (e.g. its weight-update group)
    stage: int = 0
    ep_rank: int = 0

    @property
    def sends(self) -> bool:
        return self.dense_sender or self.expert_sender

    @property
    def name(self) -> str:
        """Unique among the senders: ``pp_{stage}`` for the stage's source rank (which may send
        experts too), ``pp_{stage}-ep_{rank}`` for a rank that sends experts alone."""
        return f"pp_{self.stage}" + ("" if self.dense_sender else f"-ep_{self.ep_rank}")

    @staticmethod
    def current(has_experts: bool) -> SendRole:
        """This rank's role (every rank sends everything without parallel_state)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return SendRole()
        dense = (
            ps.get_data_parallel_rank(with_context_parallel=True) == 0
            and ps.get_context_parallel_rank() == 0
        )
        tp0 = ps.get_tensor_model_parallel_rank() == 0
        expert = has_experts and ps.get_expert_data_parallel_rank() == 0
        etp0 = ps.get_expert_tensor_parallel_rank() == 0
        return SendRole(
            dense_replica=dense,
            dense_sender=dense and tp0,
            expert_replica=expert,
            expert_sender=expert and etp0,
            stage=ps.get_pipeline_model_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank() if has_experts else 0,
        )


# ---- the per-parameter plan ------------------------------------------------------------------


@dataclass
class _Item:
    """One megatron parameter of this rank and how it maps to HF tensors."""

    mname: str  # name inside the chunk
    param: torch.Tensor
    rule: Rule
    layer: int | None  # global layer index
    local_expert: int | None
    vocab: bool = False

    @property
    def expert(self) -> bool:
        return self.local_expert is not None


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"local_experts\.(\d+)\.")


class HFBridge:
    """Maps one HF checkpoint family onto Titan's megatron-core GPT (local layer spec)."""

    def __init__(self, hf_config: dict[str, Any] | str | Path) -> None:
        self.hf = hf_config if isinstance(hf_config, dict) else read_hf_config(hf_config)
        self.family = family_of(self.hf)
        self.model_cfg = model_config_from_hf(self.hf)
        m = self.model_cfg
        self.vocab_size = int(self.hf["vocab_size"])
        self.tied = not m.untie_embeddings_and_output_weights
        self.num_heads = m.num_attention_heads
        self.num_groups = m.num_query_groups or m.num_attention_heads
        self.head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads

    # -- plan --------------------------------------------------------------------------------
    def _items(self, chunks: list[Any], layout: Layout) -> list[_Item]:
        items: list[_Item] = []
        for chunk in chunks:
            model = unwrap(chunk)
            for mname, p in model.named_parameters():
                items.append(self._item(model, mname, p, layout))
        return items

    def _item(self, model: Any, mname: str, p: torch.Tensor, layout: Layout) -> _Item:
        if mname == EMBEDDING[0]:
            return _Item(mname, p, Rule("copy", (EMBEDDING[1],)), None, None, vocab=True)
        if mname == OUTPUT[0]:
            hf = EMBEDDING[1] if self.tied else OUTPUT[1]
            return _Item(mname, p, Rule("copy", (hf,)), None, None, vocab=True)
        if mname == FINAL_NORM[0]:
            return _Item(mname, p, Rule("copy", (FINAL_NORM[1],)), None, None)
        m = _LAYER_RE.match(mname)
        if m:
            local_idx, rest = int(m.group(1)), m.group(2)
            layer = int(model.decoder.layers[local_idx].layer_number) - 1
            em = _EXPERT_RE.search(rest)
            key, local_expert = rest, None
            if em:
                local_expert = int(em.group(1))
                key = _EXPERT_RE.sub("local_experts.{e}.", rest)
            rule = self.family.layer.get(key)
            if rule is not None:
                return _Item(mname, p, rule, layer, local_expert)
        raise ConfigError(
            f"megatron parameter {mname!r} has no HF mapping for {self.hf['model_type']}; "
            "the model must be built from model_config_from_hf() with the local layer spec"
        )

    def _hf_names(self, item: _Item, expert: int | None) -> list[str]:
        names = []
        for n in item.rule.hf:
            if expert is not None:
                n = n.replace("{e}", str(expert))
            names.append(f"model.layers.{item.layer}.{n}" if item.layer is not None else n)
        return names

    def _axis(self, item: _Item, layout: Layout) -> _Axis | None:
        """The axis this parameter is split over, or None when replicated."""
        if not getattr(item.param, "tensor_model_parallel", False):
            return None
        axis = layout.etp if item.expert else layout.tp
        return axis if axis.size > 1 else None

    # -- HF <-> full megatron tensor ------------------------------------------------------------
    def merge_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """HF q/k/v -> megatron's per-group interleaved [q_g, k_g, v_g] for g in groups."""
        ng, hd = self.num_groups, self.head_dim
        tail = q.shape[1:]
        q = q.reshape(ng, -1, *tail)
        k, v = k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)

    def split_qkv(
        self, qkv: torch.Tensor, out: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Megatron's fused QKV -> HF q, k, v (copied into ``out``'s contiguous tensors if given,
        converting to their dtype)."""
        ng, hd = self.num_groups, self.head_dim
        qpg = self.num_heads // ng
        tail = qkv.shape[1:]
        g = qkv.reshape(ng, (qpg + 2) * hd, *tail)
        q, k, v = torch.split(g, [qpg * hd, hd, hd], dim=1)
        if out is not None:
            for dst, src in zip(out, (q, k, v), strict=True):
                dst.view(ng, -1, *tail).copy_(src)
            return out[0], out[1], out[2]
        return (
            q.reshape(-1, *tail).contiguous(),
            k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous(),
        )

    # -- load ----------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, chunks: list[Any], hf_dir: str | Path) -> None:
        """Copy this rank's shard of every parameter from an HF safetensors directory."""
        layout = Layout.current()
        reader = _SafetensorsDir(hf_dir)
        used: set[str] = set()
        for item in self._items(chunks, layout):
            experts = [None]
            if item.expert:
                per_rank = self._num_local_experts(item, chunks)
                experts = [layout.ep.rank * per_rank + item.local_expert]
            names = self._hf_names(item, experts[0])
            tensors = [reader.get(n) for n in names]
            used.update(names)
            local = self._shard(item, tensors, self._axis(item, layout))
            if tuple(local.shape) != tuple(item.param.shape):
                raise ConfigError(
                    f"HF {names} gives megatron {item.mname!r} shape {tuple(local.shape)}, but the "
                    f"model has {tuple(item.param.shape)}; build the model from "
                    "model_config_from_hf() of this checkpoint"
                )
            item.param.copy_(local.to(item.param.dtype))
        if layout.pp.size == 1 and layout.ep.size == 1:
            unused = set(reader.keys()) - used - ({OUTPUT[1]} if self.tied else set())
            unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
            if unused:
                raise ConfigError(
                    f"{hf_dir} has {len(unused)} tensors the Megatron model does not use, e.g. "
                    f"{sorted(unused)[:3]}; is config.json the checkpoint's own?"
                )

    def _num_local_experts(self, item: _Item, chunks: list[Any]) -> int:
        return int(self.model_cfg.num_moe_experts) // Layout.current().ep.size

    def _shard(self, item: _Item, tensors: list[torch.Tensor], axis: _Axis | None) -> torch.Tensor:
        kind = item.rule.kind
        if kind == "gate_up":
            gate, up = tensors
            if axis is not None:
                gate, up = gate.chunk(axis.size, 0)[axis.rank], up.chunk(axis.size, 0)[axis.rank]
            return torch.cat([gate, up], dim=0)
        full = self.merge_qkv(*tensors) if kind == "qkv" else tensors[0]
        if item.vocab:
            rows = item.param.shape[0] * (axis.size if axis else 1)
            if rows < full.shape[0]:
                raise ConfigError(
                    f"the model's vocabulary ({rows}) is smaller than the checkpoint's "
                    f"({full.shape[0]}); build it with vocab_size >= {full.shape[0]}"
                )
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        if axis is None:
            return full
        return full.chunk(axis.size, dim=item.param.partition_dim)[axis.rank]

    # -- export --------------------------------------------------------------------------------
    def _gather(
        self, item: _Item, axis: _Axis | None, out: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The full megatron tensor(s) of ``item`` (TP-gathered); gate/up come back split, q/k/v
        split into ``out`` when given."""
        local = item.param.detach()
        pieces = [local]
        if axis is not None:
            pieces = [torch.empty_like(local) for _ in range(axis.size)]
            dist.all_gather(pieces, local.contiguous(), group=axis.group)
        if item.rule.kind == "gate_up":
            halves = [p.chunk(2, dim=0) for p in pieces]
            if len(halves) == 1:  # views of the parameter: the bucket copy is the only copy
                return list(halves[0])
            return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
        dim = item.param.partition_dim if axis is not None else 0
        full = torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]
        if item.vocab:
            full = full[: self.vocab_size]
        if item.rule.kind == "qkv":
            return list(self.split_qkv(full, out))
        return [full]

    def _materialize(
        self,
        item: _Item,
        layout: Layout,
        chunks: list[Any],
        out: Alloc | None = None,
        gather_ep: bool = True,
    ) -> NamedTensors:
        """The full HF tensors of ``item``: TP-gathered; an expert's also EP-gathered (every
        rank's copy of this local expert) unless ``gather_ep`` is False (this rank's alone)."""
        bufs = None
        if out is not None and item.rule.kind == "qkv" and not item.expert:
            bufs = [out(n, torch.Size(s)) for n, s in self._meta(item, layout, chunks)]
        tensors = self._gather(item, self._axis(item, layout), bufs)
        if not item.expert:
            return list(zip(self._hf_names(item, None), tensors, strict=True))
        per_rank = self._num_local_experts(item, chunks)
        out: NamedTensors = []
        per_ep: list[list[torch.Tensor]] = [tensors]
        if layout.ep.size > 1 and gather_ep:
            per_ep = [[torch.empty_like(t) for t in tensors] for _ in range(layout.ep.size)]
            for j, t in enumerate(tensors):
                dist.all_gather([r[j] for r in per_ep], t.contiguous(), group=layout.ep.group)
        for r, ts in enumerate(per_ep):
            e = (r if len(per_ep) > 1 else layout.ep.rank) * per_rank + item.local_expert
            out.extend(zip(self._hf_names(item, e), ts, strict=True))
        return out

    def _meta(self, item: _Item, layout: Layout, chunks: list[Any]) -> list[tuple[str, list[int]]]:
        """Names and shapes :meth:`_materialize` will produce, without communicating."""
        axis = self._axis(item, layout)
        shape = list(item.param.shape)
        if axis is not None:
            shape[item.param.partition_dim] *= axis.size
        if item.vocab:
            shape[0] = self.vocab_size
        if item.rule.kind == "gate_up":
            shapes = [[shape[0] // 2, *shape[1:]]] * 2
        elif item.rule.kind == "qkv":
            hd, tail = self.head_dim, shape[1:]
            kv = [self.num_groups * hd, *tail]
            shapes = [[self.num_heads * hd, *tail], kv, kv]
        else:
            shapes = [shape]
        experts = [None]
        if item.expert:
            per_rank = self._num_local_experts(item, chunks)
            ranks = range(layout.ep.size) if layout.ep.size > 1 else [layout.ep.rank]
            experts = [r * per_rank + item.local_expert for r in ranks]
        return [
            (n, s) for e in experts for n, s in zip(self._hf_names(item, e), shapes, strict=True)
        ]

    def _export_items(self, chunks: list[Any], layout: Layout) -> list[_Item]:
        """This rank's parameters to export: tied, the output layer on the last stage is a
        copy of the embedding and is left out."""
        items = self._items(chunks, layout)
        if self.tied:
            has_embedding = any(i.mname == EMBEDDING[0] for i in items)
            items = [i for i in items if not (i.mname == OUTPUT[0] and has_embedding)]
            if layout.pp.size > 1:
                items = [i for i in items if i.mname != OUTPUT[0]]
        return items

    @torch.no_grad()
    def export(
        self,
        chunks: list[Any],
        bucket_bytes: int = 512 << 20,
        dst: int = 0,
        dtype: torch.dtype | None = None,
        views: bool = False,
        out: Callable[[str, torch.Size, torch.dtype], torch.Tensor] | None = None,
    ) -> Iterator[NamedTensors]:
        """Full HF tensors, bucket by bucket, on global rank ``dst``.

        Every rank must iterate the generator to the end (it takes part in the gathers); only
        ``dst`` gets buckets. A tensor larger than ``bucket_bytes`` travels alone. The tensors
        are contiguous; with ``views=True``, a local tensor may instead be a strided view of
        the live parameter (a QKV slice), for a caller that copies it into a bucket anyway and
        reads it before the next optimizer step.

        ``out(name, shape, dtype)``: on ``dst``, where to write the HF tensors the export has
        to build from a parameter's pieces (q/k/v of the fused QKV) instead of fresh memory:
        a contiguous tensor of that shape and dtype the caller owns (e.g. one in shared memory
        it reuses every sync), yielded as ``name``'s tensor.
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        layout = Layout.current()
        items = self._export_items(chunks, layout)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        param_dtype = items[0].param.dtype if items else torch.float32
        device = items[0].param.device if items else torch.device("cpu")
        out_dtype = dtype or param_dtype
        local_meta = [self._meta(i, layout, chunks) for i in items]
        if layout.pp.size > 1:
            stage_meta: list[Any] = [None] * layout.pp.size
            dist.all_gather_object(stage_meta, local_meta, group=layout.pp.group)
            pp_ranks = dist.get_process_group_ranks(layout.pp.group)
        else:
            stage_meta, pp_ranks = [local_meta], [rank]
        # The ranks in dst's pipeline column send what their stage gathered.
        sender = world == 1 or dst in pp_ranks
        alloc: Alloc | None = None
        if out is not None and rank == dst:

            def alloc(name: str, shape: torch.Size) -> torch.Tensor:
                return out(name, shape, out_dtype)

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            for stage, metas in enumerate(stage_meta):
                for idx, meta in enumerate(metas):
                    if stage == layout.pp.rank:
                        named = self._materialize(items[idx], layout, chunks, alloc)
                        named = [(n, t.to(out_dtype)) for n, t in named]
                        if rank == dst:
                            yield from named if views else ((n, t.contiguous()) for n, t in named)
                        elif sender:
                            for _, t in named:
                                dist.send(t.contiguous(), dst)
                    elif rank == dst:
                        for n, shape in meta:
                            # on the parameters' device: NCCL/MCCL cannot receive into CPU memory
                            t = torch.empty(shape, dtype=out_dtype, device=device)
                            dist.recv(t, pp_ranks[stage])
                            yield n, t

        yield from _bucketed(received(), bucket_bytes)

    def has_experts(self) -> bool:
        return bool(self.model_cfg.num_moe_experts)

    @torch.no_grad()
    def export_shard(
        self,
        chunks: list[Any],
        bucket_bytes: int = 512 << 20,
        dtype: torch.dtype | None = None,
        views: bool = False,
        out: Callable[[str, torch.Size, torch.dtype], torch.Tensor] | None = None,
    ) -> Iterator[NamedTensors]:
        """This rank's part of the model as full HF tensors, bucket by bucket (see
        :class:`SendRole`): a stage's source rank yields the stage's dense tensors (and its
        experts), an EP rank of the first expert-data-parallel replica its own experts, every
        other rank nothing. Every rank must iterate the generator to the end (the TP and
        expert-TP gathers run inside it); no tensor crosses a stage or an EP rank, so a rank
        holds at most its stage's share plus one bucket. ``views``, ``out``: as :meth:`export`.
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        layout = Layout.current()
        role = SendRole.current(self.has_experts())
        items = self._export_items(chunks, layout)
        out_dtype = dtype or (items[0].param.dtype if items else torch.float32)
        alloc: Alloc | None = None
        if out is not None:

            def alloc(name: str, shape: torch.Size) -> torch.Tensor:
                return out(name, shape, out_dtype)

        def mine() -> Iterator[tuple[str, torch.Tensor]]:
            for item in items:
                replica, sender = (
                    (role.expert_replica, role.expert_sender)
                    if item.expert
                    else (role.dense_replica, role.dense_sender)
                )
                if not replica:
                    continue
                named = self._materialize(
                    item, layout, chunks, alloc if sender else None, gather_ep=False
                )
                if not sender:  # took part in the gather
                    continue
                for n, t in named:
                    t = t.to(out_dtype)
                    yield n, (t if views else t.contiguous())

        yield from _bucketed(mine(), bucket_bytes)


def _bucketed(
    tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[NamedTensors]:
    """``tensors`` in buckets of at most ``bucket_bytes`` (a larger tensor travels alone),
    drawn lazily: the gathers behind ``tensors`` run as the buckets are taken."""
    bucket: NamedTensors = []
    size = 0
    for n, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((n, t))
        size += nbytes
    if bucket:
        yield bucket


class _SafetensorsDir:
    """Lazy tensor access to an HF safetensors directory (sharded or not)."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files or not files[0].exists():
            raise ConfigError(f"no *.safetensors files in {p}; save with safe_serialization=True")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for h in self._handles:
            for k in h.keys():  # noqa: SIM118 (safe_open has no __iter__)
                self._where[k] = h
        self.path = p

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        h = self._where.get(name)
        if h is None:
            raise ConfigError(f"{self.path} has no tensor {name!r}; is it a matching checkpoint?")
        return h.get_tensor(name)


def load_hf_weights(chunks: list[Any], hf_dir: str | Path) -> HFBridge:
    """Load ``hf_dir`` into ``chunks`` (this rank's shards); returns the bridge for export."""
    bridge = HFBridge(hf_dir)
    bridge.load(chunks, hf_dir)
    return bridge


def export_hf_weights(
    chunks: list[Any],
    hf_config: dict[str, Any] | str | Path,
    bucket_bytes: int = 512 << 20,
    dst: int = 0,
    dtype: torch.dtype | None = None,
) -> Iterator[NamedTensors]:
    """See :meth:`HFBridge.export`."""
    return HFBridge(hf_config).export(chunks, bucket_bytes, dst, dtype)
