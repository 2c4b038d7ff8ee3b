"""Routed experts: which experts each token went to in every MoE layer (SGLang's R3 output).

The recorder hooks each MoE layer's router (``mlp.gate`` of Qwen3-MoE, whose forward returns
``(logits, weights, indices)``) and keeps the top-k expert indices of the last forward. The
layout is SGLang's ``meta_info["routed_experts"]``: base64 of a little-endian int32 C-order
array ``[tokens, num_hidden_layers, top_k]``; rows of dense layers stay 0, as in SGLang's
capture buffer. A response covers the tokens ``[routed_experts_start_len, seqlen - 1)``: the
last sampled token is never fed to the model, so it has no routing.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch


class RoutingRecorder:
    """Captures the router's top-k indices of every MoE layer during a forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        layers = model.model.layers
        self.num_layers = int(config.num_hidden_layers)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.moe_layers: list[int] = []
        self._captured: dict[int, torch.Tensor] = {}
        self.enabled = False
        for i, layer in enumerate(layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(getattr(layer.mlp, "experts", None), "forward"):
                gate.register_forward_hook(self._hook(i))
                self.moe_layers.append(i)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers) and self.top_k > 0

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self.enabled:
                indices = output[-1] if isinstance(output, tuple) else output
                if indices.dtype.is_floating_point:
                    raise RuntimeError(
                        f"the router of layer {layer} ({type(module).__name__}) does not return "
                        "expert indices last; routed experts cannot be recorded for this model"
                    )
                self._captured[layer] = indices.to(torch.int32)

        return hook

    def start(self) -> None:
        """Record the next forward."""
        self._captured = {}
        self.enabled = True

    def stop(self, batch: int, length: int) -> torch.Tensor:
        """The recorded forward's routing as ``[batch, length, num_layers, top_k]`` int32."""
        self.enabled = False
        out = torch.zeros(batch * length, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, indices in self._captured.items():
            out[:, layer] = indices.reshape(batch * length, self.top_k)
        self._captured = {}
        return out.view(batch, length, self.num_layers, self.top_k)


def encode_routed_experts(rows: torch.Tensor) -> str:
    """SGLang's wire form: base64 of the little-endian int32 bytes, C order."""
    arr = np.ascontiguousarray(rows.numpy().astype("<i4", copy=False))
    return base64.b64encode(arr.tobytes()).decode("ascii")


__all__ = ["RoutingRecorder", "encode_routed_experts"]
