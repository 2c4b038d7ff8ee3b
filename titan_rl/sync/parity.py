"""The parity probe: a fixed token batch scored by the engine and by the trainer."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from titan_rl.rollout import SGLangClient


def probe_batch(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num, length), generator=g).tolist()


async def engine_logprobs(client: SGLangClient, probe: list[list[int]]) -> list[torch.Tensor]:
    """Input-token logprobs (tokens 1..L-1) of each probe sequence, from ``/generate``."""
    outs = await client.generate_batch(
        probe, {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True, logprob_start_len=0
    )
    result = []
    for o in outs:
        rows = o.meta_info.get("input_token_logprobs") or []
        vals = [r[0] for r in rows[1:]]
        if len(vals) != len(probe[0]) - 1 or any(v is None for v in vals):
            raise RuntimeError(
                f"{client.base_url} returned {len(vals)} input logprobs for a {len(probe[0])}-token"
                " probe; the engine must support return_logprob with logprob_start_len=0"
            )
        result.append(torch.tensor(vals, dtype=torch.float64))
    return result


@torch.no_grad()
def trainer_logprobs(
    chunks: list[Any], probe: list[list[int]], vocab_size: int
) -> list[torch.Tensor]:
    """Next-token logprobs of the probe under the megatron model (every TP rank calls this)."""
    from megatron.core import parallel_state as ps

    from titan_core.checkpoint.dist import unwrap

    if len(chunks) != 1 or ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError(
            "the built-in trainer probe runs without pipeline parallelism; pass "
            "trainer_logprobs_fn to WeightSync for PP > 1"
        )
    model = unwrap(chunks[0])
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    try:
        for seq in probe:
            ids = torch.tensor([seq], device=device)
            pos = torch.arange(len(seq), device=device).unsqueeze(0)
            logits = model(ids, pos, attention_mask=None)
            tp = ps.get_tensor_model_parallel_world_size()
            if tp > 1:
                parts = [torch.empty_like(logits) for _ in range(tp)]
                dist.all_gather(
                    parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group()
                )
                logits = torch.cat(parts, dim=-1)
            lp = torch.log_softmax(logits[0, :-1, :vocab_size].double(), dim=-1)
            out.append(lp.gather(1, ids[0, 1:].unsqueeze(1)).flatten().cpu())
    finally:
        model.train(was_training)
    return out


def compare(engine: list[torch.Tensor], trainer: list[torch.Tensor]) -> tuple[float, float]:
    diff = torch.cat([(a - b).abs() for a, b in zip(engine, trainer, strict=True)])
    return float(diff.mean()), float(diff.max())
