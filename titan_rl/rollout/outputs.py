"""What a sample takes from an engine's answer: its status and its routed experts."""

from __future__ import annotations

import torch

from titan_rl.rollout.engine_api import EngineError, GenerateOutput
from titan_rl.sample import Status


def finish_status(out: GenerateOutput) -> Status:
    """TRUNCATED at the token limit, ABORTED when aborted, else COMPLETED."""
    return {"length": Status.TRUNCATED, "abort": Status.ABORTED}.get(
        out.finish_type, Status.COMPLETED
    )


def routed_experts_tensor(out: GenerateOutput, num_layers: int | None) -> torch.Tensor | None:
    """The answer's routed experts ``[tokens, num_layers, top_k]`` (None when not asked, or
    for a request aborted before it ran)."""
    if num_layers is None:
        return None
    routed = out.routed_experts(num_layers)
    if routed is None and out.aborted:  # aborted while queued: the prompt never ran
        return None
    if routed is None:
        raise EngineError(
            "rollout.return_routed_experts is on but the engine answered no routed_experts; "
            "serve an MoE model (SGLang: launched with --enable-return-routed-experts)"
        )
    return torch.from_numpy(routed)
