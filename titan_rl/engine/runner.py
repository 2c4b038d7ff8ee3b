"""One process's model and KV cache, and the interface the engine runs its model through.

The :class:`~titan_rl.engine.core.Engine` schedules sequences; a :class:`Runner` runs what
touches the model: the forwards (prefill chunks, decode steps, the running batch's rows), the
weights by HF checkpoint name (reads, loads, staged updates, weight-update groups) and their
memory. Two implement it: :class:`ModelRunner`, one process's model (or one TP rank's shard of
it), its running batch's KV cache, its left-padded attention mask and per-row positions and the
partial caches of prompts being prefilled chunk by chunk; and, with ``--tp-size N``, the TP
leader (:class:`~titan_rl.engine.tp.leader.TPRunner`), which runs every operation on the N-1
worker processes' runners and on rank 0's own, in lockstep. The engine never asks which.

Weight updates always carry full HF tensors: names and shapes are checked against the full
checkpoint, and each rank copies its shard (:class:`~titan_rl.engine.tp.shard.Split`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from titan_rl.engine.lean import LeanForward, lean_forward
from titan_rl.engine.routing import RoutingRecorder
from titan_rl.engine.sampling import RequestError
from titan_rl.engine.tp.shard import Reduce, Split, expert_splits, shard_model
from titan_rl.engine.weights import Source, checkpoint_tensors, join_weight_update_group
from titan_rl.engine_settings import ModelImpl

NamedTensors = list[tuple[str, torch.Tensor]]

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine's scheduler runs on (its thread only, except the reads of names).

    ``model`` is this process's (with TP: rank 0's shard); ``routing`` records its routed
    experts. The forwards and the memory calls return what rank 0 computes; a failure inside
    one after the TP workers ran it leaves the runner dead (``alive`` false).
    """

    model: torch.nn.Module
    routing: RoutingRecorder

    @property
    def alive(self) -> bool:
        """False once a TP worker died or the ranks fell out of lockstep."""
        ...

    # ---- forwards (see ModelRunner's) ------------------------------------------------------
    def prefill(
        self,
        key: int,
        ids: torch.Tensor,
        total: int,
        logits_to_keep: int,
        record: bool,
        rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def keep_prefill(self, key: int, rows: list[int]) -> None: ...

    def decode(
        self, ids: torch.Tensor, record: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def select_rows(self, keep: list[int]) -> None: ...

    def reset(self) -> None: ...

    # ---- memory ------------------------------------------------------------------------------
    def release_weights(self) -> None: ...

    def resume_weights(self) -> None: ...

    def weight_bytes(self) -> int: ...

    # ---- weights by HF checkpoint name -------------------------------------------------------
    def param_names(self) -> set[str]: ...

    def knows(self, name: str) -> bool: ...

    def missing_params(self, names: set[str]) -> set[str]: ...

    def tensor(self, name: str) -> torch.Tensor | None: ...

    def full_tensor(self, name: str) -> torch.Tensor | None: ...

    def load(self, named: NamedTensors) -> int: ...

    def update(
        self, source: Source, own: Callable[[], NamedTensors], new_version: bool = False
    ) -> int: ...

    def join_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> Any: ...

    def destroy_group(self, group_name: str) -> None: ...

    def close(self) -> None: ...


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
    """The model (or a TP rank's shard), the running batch's KV cache, and weight loads: the
    :class:`Runner` of a single-process engine, and each TP rank's own part.

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
        model_impl: ModelImpl = "auto",
    ) -> None:
        self.model = model
        self.config = model.config
        #: the forward the batch runs through: the engine's own, or transformers'
        self.model_impl, lean = _pick_forward(model, model_impl)
        self._run: Callable[..., torch.Tensor] = lean or self._transformers
        self.rank, self.size = rank, size
        #: the experts each token is routed to, recorded for requests that ask for them
        self.routing = RoutingRecorder(model)
        # HF checkpoint names -> the model's tensors (per-expert names onto fused experts)
        self._targets, self._fused = checkpoint_tensors(model)
        self._param_names = set(self._targets) - set(self._fused.values())
        self.full_shapes = full_shapes or {n: t.shape for n, t in self._targets.items()}
        self.splits = {**(splits or {}), **expert_splits(self._fused, size)}
        self._released_shapes: dict[int, torch.Size] = {}
        #: the weights' storage is freed (release_weights): updates are refused until resumed
        self.weights_released = False
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

    def _transformers(
        self,
        input_ids: torch.Tensor,
        cache: Any,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, cache=cache, use_cache=True, attention_mask=attention_mask,
            position_ids=position_ids, logits_to_keep=logits_to_keep,
        )  # fmt: skip
        return out.logits

    def _forward(
        self, record: bool, input_ids: torch.Tensor, cache: Any, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward's logits, and its routed experts ``[B, L, layers, top_k]`` when
        ``record``."""
        if not record:
            return self._run(input_ids, cache, **kw), None
        self.routing.start()
        try:
            logits = self._run(input_ids, cache, **kw)
        finally:
            routed = self.routing.stop(*input_ids.shape)
        return logits, routed

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
        logits, routed = self._forward(record, ids, cache, logits_to_keep=logits_to_keep)
        self.partial[key] = cache  # not kept if the forward failed: its layers may disagree
        return logits, routed

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
        logits, routed = self._forward(
            record, ids, self.cache, attention_mask=mask, position_ids=self.pos.unsqueeze(1)
        )
        self.mask = mask
        self.pos = self.pos + 1
        return logits[:, -1, :], routed

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

    def check_held(self) -> None:
        """RequestError while the weights are released (an update would land nowhere)."""
        if self.weights_released:
            raise RequestError(
                "the weights are released; call /resume_memory_occupation with tags "
                "['weights'] before updating them"
            )

    def load(self, named: NamedTensors) -> int:
        """Copy (this rank's shard of) full checkpoint tensors in; checked first."""
        self.check_held()
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
        self.weights_released = True

    def resume_weights(self) -> None:
        """Allocate the weights again, NaN (as without torch_memory_saver's backup)."""
        for p in self.model.parameters():
            p.data = torch.full(self._released_shapes[id(p)], float("nan"), dtype=p.dtype)
        self._released_shapes = {}
        self._targets, self._fused = checkpoint_tensors(self.model)
        self.weights_released = False

    # ---- the rest of the Runner interface: this process is every rank ----------------------
    @property
    def alive(self) -> bool:
        return True

    def full_tensor(self, name: str) -> torch.Tensor | None:
        """The whole checkpoint tensor: this process holds it (TP 1)."""
        return self.tensor(name)

    def update(
        self, source: Source, own: Callable[[], NamedTensors], new_version: bool = False
    ) -> int:
        """Apply an update whose full tensors ``own`` gives (called here, on the engine
        thread); ``source`` is where TP workers would read theirs (none here)."""
        self.check_held()
        return self.load(own())

    def join_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> Any:
        """Join the trainer's weight-update group as this engine's only rank."""
        return join_weight_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def destroy_group(self, group_name: str) -> None:
        """Nothing to leave: the group this process joined is its caller's (the server's)."""

    def close(self) -> None:
        """Nothing to stop: no other process."""


def _pick_forward(model: torch.nn.Module, impl: ModelImpl) -> tuple[str, LeanForward | None]:
    """``--model-impl``: ``sglang`` (the engine's own forward, titan_rl/engine/lean.py),
    ``transformers`` (the HF model's forward) or ``auto`` (the engine's own where it runs the
    model). Returns the one picked (``sglang`` / ``transformers``) and the own forward (None:
    transformers'); ValueError where ``sglang`` cannot run the model."""
    if impl == "transformers":
        return "transformers", None
    lean = lean_forward(model)
    if isinstance(lean, LeanForward):
        return "sglang", lean
    if impl == "sglang":
        raise ValueError(
            f"--model-impl sglang: the engine's own forward cannot run this model ({lean}); "
            "use --model-impl auto or transformers"
        )
    log.info("the engine's own forward cannot run this model (%s): transformers' runs it", lean)
    return "transformers", None


def build_runner(
    model: torch.nn.Module, rank: int, size: int, reduce: Reduce, model_impl: ModelImpl = "auto"
) -> ModelRunner:
    """Shard ``model`` for ``rank`` of ``size`` and wrap it in a runner."""
    full_shapes = {n: t.shape for n, t in checkpoint_tensors(model)[0].items()}
    splits = shard_model(model, rank, size, reduce)
    return ModelRunner(model, full_shapes, splits, rank, size, model_impl)


__all__ = ["build_runner", "DTYPES", "ModelRunner", "NamedTensors", "Runner", "load_model"]
