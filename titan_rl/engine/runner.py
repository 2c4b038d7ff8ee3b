"""One process's model and KV cache: every operation of the engine that touches the model.

The :class:`~titan_rl.engine.core.Engine` schedules sequences; a runner holds what the
forwards need (the model, or this TP rank's shard of it, the running batch's KV cache, its
left-padded attention mask and per-row positions, the partial caches of prompts being
prefilled chunk by chunk) and the weights by HF checkpoint name. With
``--tp-size N`` every rank holds one runner and runs the same operations in lockstep
(:mod:`titan_rl.engine.tp`); at N = 1 the engine calls its runner directly.

Weight updates always carry full HF tensors: names and shapes are checked against the full
checkpoint, and each rank copies its shard (:class:`~titan_rl.engine.tp_shard.Split`).
"""

from __future__ import annotations

from typing import Any

import torch

from titan_rl.engine.routing import RoutingRecorder
from titan_rl.engine.sampling import RequestError
from titan_rl.engine.tp_shard import Reduce, Split, expert_splits, shard_model
from titan_rl.engine.weights import checkpoint_tensors

NamedTensors = list[tuple[str, torch.Tensor]]


#: ``--dtype`` -> what ``from_pretrained`` takes
DTYPES: dict[str, Any] = {
    "auto": "auto",
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def load_model(path: str, dtype: str) -> torch.nn.Module:
    """The HF causal LM at ``path`` in ``dtype`` (a ``--dtype`` choice), for inference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.eval()
    model.requires_grad_(False)
    return model


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class ModelRunner:
    """The model (or a TP rank's shard), the running batch's KV cache, and weight loads.

    ``full_shapes``: the checkpoint shape of every name (taken before sharding); ``splits``:
    how each sharded name maps to this rank's part (names absent are whole on every rank).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        full_shapes: dict[str, torch.Size] | None = None,
        splits: dict[str, Split] | None = None,
        rank: int = 0,
        size: int = 1,
    ) -> None:
        self.model = model
        self.config = model.config
        self.rank, self.size = rank, size
        #: the experts each token is routed to, recorded for requests that ask for them
        self.routing = RoutingRecorder(model)
        # HF checkpoint names -> the model's tensors (per-expert names onto fused experts)
        self._targets, self._fused = checkpoint_tensors(model)
        self._param_names = set(self._targets) - set(self._fused.values())
        self.full_shapes = full_shapes or {n: t.shape for n, t in self._targets.items()}
        self.splits = {**(splits or {}), **expert_splits(self._fused, size)}
        self._released_shapes: dict[int, torch.Size] = {}
        #: the caches of prompts being prefilled (chunk by chunk), by the engine's unit key,
        #: until keep_prefill merges them into the running batch
        self.partial: dict[int, Any] = {}
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, T] long
        self.pos: torch.Tensor | None = None  # [B] next position per row

    # ---- forwards -----------------------------------------------------------------------
    def _new_cache(self, reserve: int = 0) -> Any:
        from titan_rl.engine.kv_cache import new_cache  # transformers, loaded with the model

        return new_cache(self.config, reserve)

    def _forward(self, record: bool, input_ids: torch.Tensor, **kw: Any) -> tuple[Any, Any]:
        """One forward, and its routed experts ``[B, L, layers, top_k]`` when ``record``."""
        if not record:
            return self.model(input_ids=input_ids, **kw), None
        self.routing.start()
        try:
            out = self.model(input_ids=input_ids, **kw)
        finally:
            routed = self.routing.stop(*input_ids.shape)
        return out, routed

    def prefill(
        self,
        key: int,
        ids: torch.Tensor,
        total: int,
        logits_to_keep: int,
        record: bool,
        rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward the next chunk ``ids`` ``[k, n]`` of ``k`` equal-length prompts (``total``
        tokens each) into their partial cache ``key`` (a fresh one at the first chunk), kept
        until :meth:`keep_prefill`; ``rows``: the rows of that cache these prompts are (the
        others are dropped first; None: all). A chunk's positions follow the cache's length,
        so the chunks of a prompt compute what one forward of the whole prompt does.
        The logits of the chunk's last ``logits_to_keep`` positions, and its routed experts."""
        cache = self.partial.pop(key, None)
        if cache is None:
            cache = self._new_cache(total)
        elif rows is not None:
            idx = torch.tensor(rows, dtype=torch.long)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[idx], layer.values[idx]
        out, routed = self._forward(
            record, input_ids=ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep
        )
        self.partial[key] = cache  # not kept if the forward failed: its layers may disagree
        return out.logits, routed

    def keep_prefill(self, key: int, rows: list[int]) -> None:
        """Merge the rows ``rows`` of the prefilled prompts ``key`` into the running batch
        (left-padded); the rest of that cache is dropped (``rows`` empty: all of it)."""
        staged = self.partial.pop(key, None)
        if not rows or staged is None:
            return
        length = staged.layers[0].keys.shape[2]
        kv = [(layer.keys[rows], layer.values[rows]) for layer in staged.layers]
        del staged
        mask = torch.ones(len(rows), length, dtype=torch.long)
        pos = torch.full((len(rows),), length, dtype=torch.long)
        if self.cache is None:
            self.cache = self._new_cache()
            for layer, (k, v) in zip(self.cache.layers, kv, strict=True):
                layer.update(k.contiguous(), v.contiguous())
            self.mask, self.pos = mask, pos
            return
        t_old, t_new = self.mask.shape[1], length
        width = max(t_old, t_new)
        for layer, (k, v) in zip(self.cache.layers, kv, strict=True):
            layer.keys = torch.cat(
                [_pad_left(layer.keys, width - t_old, 2), _pad_left(k, width - t_new, 2)]
            )
            layer.values = torch.cat(
                [_pad_left(layer.values, width - t_old, 2), _pad_left(v, width - t_new, 2)]
            )
        self.mask = torch.cat(
            [_pad_left(self.mask, width - t_old, 1), _pad_left(mask, width - t_new, 1)]
        )
        self.pos = torch.cat([self.pos, pos])

    def decode(self, ids: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of the running batch (``ids``: ``[B, 1]``); the last logits."""
        mask = torch.cat([self.mask, torch.ones(ids.shape[0], 1, dtype=torch.long)], dim=1)
        out, routed = self._forward(
            record,
            input_ids=ids,
            attention_mask=mask,
            position_ids=self.pos.unsqueeze(1),
            cache=self.cache,
            use_cache=True,
        )
        self.mask = mask
        self.pos = self.pos + 1
        return out.logits[:, -1, :], routed

    def select_rows(self, keep: list[int]) -> None:
        """Keep the batch rows ``keep``; drop columns that are padding for every one left
        (``keep`` empty: the running batch is gone; prompts being prefilled are kept)."""
        if not keep:
            self.cache, self.mask, self.pos = None, None, None
            return
        idx = torch.tensor(keep, dtype=torch.long)
        mask = self.mask[idx]
        lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, lead:]
            layer.values = layer.values[idx, :, lead:]
        self.mask = mask[:, lead:]
        self.pos = self.pos[idx]

    def reset(self) -> None:
        """Drop the running batch's cache and every partial prefill's."""
        self.cache, self.mask, self.pos = None, None, None
        self.partial = {}

    # ---- weights --------------------------------------------------------------------------
    def param_names(self) -> set[str]:
        return set(self._param_names)

    def knows(self, name: str) -> bool:
        return name in self._targets

    def missing_params(self, names: set[str]) -> set[str]:
        return {n for n in self._param_names if n not in names and self._fused.get(n) not in names}

    def tensor(self, name: str) -> torch.Tensor | None:
        """This rank's tensor (or shard) under an HF name (meta while released), or None."""
        return self._targets.get(name)

    def check(self, named: NamedTensors) -> None:
        """Every name known and every shape the full checkpoint's (RequestError if not)."""
        for name, t in named:
            shape = self.full_shapes.get(name)
            if shape is None:
                raise RequestError(f"unknown parameter {name!r}; names must be the HF checkpoint's")
            if tuple(shape) != tuple(t.shape):
                raise RequestError(
                    f"parameter {name!r} has shape {tuple(shape)}, got {tuple(t.shape)}"
                )

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor ``full`` (a view where it can be)."""
        split = self.splits.get(name)
        return full if split is None else split.take(full, self.rank, self.size)

    def load(self, named: NamedTensors) -> int:
        """Copy (this rank's shard of) full checkpoint tensors in; checked first."""
        self.check(named)
        for name, t in named:
            self._targets[name].copy_(self.shard(name, t))
        return len(named)

    def weight_bytes(self) -> int:
        """Bytes the parameters hold now (0 while released); tied ones counted once."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def release_weights(self) -> None:
        self._targets = {
            n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in self._targets.items()
        }  # the real views would keep the storages alive
        self._released_shapes = {}
        for p in self.model.parameters():
            self._released_shapes[id(p)] = p.shape
            p.data = torch.empty(0, dtype=p.dtype)

    def resume_weights(self) -> None:
        """Allocate the weights again, NaN (as without torch_memory_saver's backup)."""
        for p in self.model.parameters():
            p.data = torch.full(self._released_shapes[id(p)], float("nan"), dtype=p.dtype)
        self._released_shapes = {}
        self._targets, self._fused = checkpoint_tensors(self.model)


def build_runner(model: torch.nn.Module, rank: int, size: int, reduce: Reduce) -> ModelRunner:
    """Shard ``model`` for ``rank`` of ``size`` and wrap it in a runner."""
    full_shapes = {n: t.shape for n, t in checkpoint_tensors(model)[0].items()}
    splits = shard_model(model, rank, size, reduce)
    return ModelRunner(model, full_shapes, splits, rank, size)


__all__ = ["build_runner", "DTYPES", "ModelRunner", "NamedTensors", "load_model"]
