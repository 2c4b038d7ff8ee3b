"""Routing replay (R3) in the trainer's MoE routers, and how often the trainer's own router
agrees with the rollout engine's routing.

Replay uses megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``): before each
forward of a model chunk, every MoE router of the chunk gets the rollout's experts for the
tokens it sees, as rows in the router's own order (``[seq, batch]`` flattened; under sequence
parallelism this TP rank's share of the sequence). Each router finds its slice by its global
layer number, so pipeline stages, virtual stages and dense layers need no bookkeeping; expert
parallelism changes nothing (routers are replicated, each rank routes its own rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from titan_core.checkpoint.dist import unwrap


def moe_routers(chunk: torch.nn.Module) -> list[TopKRouter]:
    """The MoE routers of a model chunk (DDP-wrapped or not), in layer order."""
    return [m for m in unwrap(chunk).modules() if isinstance(m, TopKRouter)]


def router_rows(routed: torch.Tensor, router: TopKRouter, sequence_parallel: bool) -> torch.Tensor:
    """``routed`` ``[batch, seq, layers, top_k]`` -> this router's rows ``[seq * batch, top_k]``
    in the order it sees its tokens (-1 rows: no routing reported)."""
    layer = router.layer_number - 1  # megatron's layer numbers are global and 1-based
    if layer >= routed.shape[2] or routed.shape[3] != router.topk:
        raise ValueError(
            f"the rollout's routed experts are [tokens, {routed.shape[2]} layers, top-"
            f"{routed.shape[3]}] but the trainer's MoE layer {layer} routes top-{router.topk}: "
            "the engine serves another model than the trainer's policy"
        )
    rows = routed[:, :, layer].transpose(0, 1)  # [seq, batch, top_k]
    if sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        rows = rows.chunk(tp, dim=0)[rank]
    return rows.reshape(-1, router.topk)


class RoutingReplay:
    """Sets the rollout's routing on the routers before each forward (when ``replay``) and,
    inside ``measure()``, counts the token x layer routings where the router's own top-k
    picks the same expert set as the rollout did."""

    def __init__(self, replay: bool, sequence_parallel: bool) -> None:
        self.replay = replay
        self.sequence_parallel = sequence_parallel
        self._rows: dict[TopKRouter, torch.Tensor] = {}
        #: [agreeing, counted] routings since measure() began, on this rank
        self._counts: torch.Tensor | None = None
        #: inside a schedule's forward of a microbatch (counting(): what measure() counts)
        self._counting = False

    def set_targets(self, chunk: torch.nn.Module, routed: torch.Tensor) -> None:
        """Before ``chunk``'s forward of a microbatch whose routing is ``routed``."""
        for router in moe_routers(chunk):
            rows = router_rows(routed, router, self.sequence_parallel)
            self._rows[router] = rows
            if self.replay:
                # rows without routing (padding, last token): any k distinct experts
                fill = torch.arange(router.topk, device=rows.device).expand_as(rows)
                router.router_replay.set_target_indices(torch.where(rows < 0, fill, rows))
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self, chunks: list[torch.nn.Module]) -> None:
        """After a schedule over ``chunks``: the routers route on their own again."""
        for chunk in chunks:
            for router in moe_routers(chunk):
                self._rows.pop(router, None)
                if router.router_replay is not None:
                    router.router_replay.clear_indices()
                    router.router_replay.clear_router_replay_action()

    @contextlib.contextmanager
    def measure(self, chunks: list[torch.nn.Module]) -> Iterator[None]:
        """Count agreements in the forwards run inside; read them with ``agreement()``."""
        self._counts = torch.zeros(2, dtype=torch.float64)
        hooks = [
            router.register_forward_hook(self._count)
            for chunk in chunks
            for router in moe_routers(chunk)
        ]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Around a schedule's forward of a microbatch: measure() counts the routings made
        inside only, so an activation recompute in the backward (the routers again, on the
        same tokens) does not count them twice."""
        self._counting = True
        try:
            yield
        finally:
            self._counting = False

    def agreement(self) -> float | None:
        """The share of agreeing routings over every rank (a collective: call it on all);
        None when nothing was counted."""
        counts = self._counts if self._counts is not None else torch.zeros(2, dtype=torch.float64)
        self._counts = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)  # TP replicas count alike: the share is unchanged
        return float(counts[0] / counts[1]) if counts[1] > 0 else None

    @torch.no_grad()
    def _count(self, router: TopKRouter, args: tuple, output: object) -> None:  # noqa: ARG002
        rows = self._rows.get(router)
        if rows is None or self._counts is None or not self._counting:
            return
        c = router.config
        logits = router.gating(args[0]).view(-1, c.num_moe_experts)
        _, own = topk_routing_with_score_function(  # the router's choice, replay or not
            logits, router.topk, use_pre_softmax=c.moe_router_pre_softmax,
            num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
            scaling_factor=c.moe_router_topk_scaling_factor, score_function=router.score_function,
            expert_bias=router.expert_bias, fused=False,
        )  # fmt: skip
        rows = rows.to(own.device)
        valid = rows[:, 0] >= 0
        rollout = torch.zeros_like(own).scatter_(1, rows.clamp(min=0), True)
        same = (own == rollout).all(dim=1) & valid
        self._counts += torch.tensor([float(same.sum()), float(valid.sum())], dtype=torch.float64)
