"""MoE expert load per step: tokens per expert, max over mean, per MoE layer.

A forward hook on each megatron-core ``TopKRouter`` adds up the routing map (the tokens each
expert processes: after capacity dropping, padding to capacity excluded) over the step's
microbatches. Like megatron's own expert-bias counter it counts only forwards with autograd
on, so evaluation is not counted. At the end of a step one all-reduce of a small
``[num_layers, num_experts]`` tensor over the whole world gives every rank the global count:
ranks of one pipeline stage hold the same layers and route disjoint tokens (DP, and EP, which
megatron carves out of DP), other stages add zeros. Under TP without sequence parallelism the
TP ranks route the same tokens, which scales a row and leaves max/mean unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from torch.utils.hooks import RemovableHandle


def load_imbalance(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """max / mean of the last dimension (1.0: perfectly balanced); rows with no tokens give 0."""
    counts = tokens_per_expert.double()
    mean = counts.mean(dim=-1)
    return torch.where(
        mean > 0, counts.amax(dim=-1) / mean.clamp(min=1e-30), torch.zeros_like(mean)
    )


class MoELoadTracker:
    """Counts routed tokens per (global layer, expert) over a training step.

    ``reset()`` before the step, ``collect()`` after it on every rank (a collective)."""

    def __init__(
        self, chunks: list[torch.nn.Module], num_layers: int, num_experts: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._handles: list[RemovableHandle] = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self._handles.append(module.register_forward_hook(self._hook))

    def _hook(self, router: TopKRouter, _inputs: tuple, output: tuple) -> None:
        if not torch.is_grad_enabled():  # evaluation (and a checkpointed first pass)
            return
        probs, routing_map = output
        with torch.no_grad():
            taken = routing_map.bool()
            if router.config.moe_pad_expert_input_to_capacity:
                taken = taken & (probs.detach() != 0)  # padding slots carry zero probability
            self.counts[router.layer_number - 1] += taken.sum(dim=0).to(self.counts.device)

    def reset(self) -> None:
        self.counts.zero_()

    def collect(self) -> dict[str, float]:
        """``moe/load_imbalance_layer{i}`` (0-based global layer index, MoE layers only) and
        ``moe/load_imbalance_max`` for the step since ``reset()``."""
        counts = self.counts.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        ratio = load_imbalance(counts).tolist()
        routed = (counts.sum(dim=-1) > 0).tolist()
        record = {
            f"moe/load_imbalance_layer{i}": r
            for i, (r, on) in enumerate(zip(ratio, routed, strict=True))
            if on
        }
        if record:
            record["moe/load_imbalance_max"] = max(record.values())
        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
