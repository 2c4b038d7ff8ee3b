"""The parity check after a sync: a fixed token batch (the probe) scored by the engines and by
the trainer; mean / max |diff| of their logprobs against ``sync.max_logprob_diff``.

With a version, an engine is scored only if it reports that version before and after its
probe (one that died and restarted serves other weights: it is not what the sync wrote, and
its resync has its own check); ``sync/parity_skipped`` counts the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from titan_rl.rollout.engine_api import EngineClient, EngineUnavailableError
from titan_rl.sync.config import SyncConfig
from titan_rl.sync.transports.base import Engine

log = logging.getLogger(__name__)


class ParityError(RuntimeError):
    """Engine and trainer logprobs differ by more than ``sync.max_logprob_diff``."""


def probe_batch(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num, length), generator=g).tolist()


async def engine_logprobs(client: EngineClient, probe: list[list[int]]) -> list[torch.Tensor]:
    """Input-token logprobs (tokens 1..L-1) of each probe sequence, from ``/generate``."""
    outs = await client.generate_batch(
        probe, {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True, logprob_start_len=0
    )
    result = []
    for o in outs:
        vals = (o.input_logprobs or [])[1:]
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
    """Next-token logprobs (float64, CPU) of the probe under the megatron model.

    Every rank of the model-parallel group calls this: the probe runs through megatron-core's
    forward-only schedule (one sequence per microbatch), so TP, PP and VPP layouts all take
    part; the last pipeline stage gathers the vocab-parallel logits over TP and computes the
    logprobs in float64, then broadcasts them over its pipeline group, so every rank (the
    sync's dst rank among them) returns the same tensors.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from titan_core.accelerator import megatron_scope
    from titan_core.checkpoint.dist import unwrap

    if ps.get_context_parallel_world_size() > 1:
        raise NotImplementedError(
            "the trainer probe does not split sequences for context parallelism; set "
            "sync.check_every=0 with parallel.context_parallel_size > 1"
        )
    models = [unwrap(c) for c in chunks]
    if not models:
        raise ValueError("trainer_logprobs needs the model chunks")
    lengths = {len(s) for s in probe}
    if len(lengths) != 1 or not probe:
        raise ValueError("the probe must be a non-empty batch of equal-length sequences")
    length = lengths.pop()
    num = len(probe)
    device = next(models[0].parameters()).device
    pp = ps.get_pipeline_model_parallel_world_size()
    # The interleaved (VPP) schedule wants whole groups of microbatches: pad with repeats.
    num_mb = num
    if len(models) > 1:
        group = getattr(get_model_config(models[0]), "microbatch_group_size_per_vp_stage", None)
        group = max(group or pp, pp)
        num_mb = -(-num // group) * group
    rows = [probe[i % num] for i in range(num_mb)]

    def batches() -> Iterator[torch.Tensor]:
        for seq in rows:
            yield torch.tensor([seq], dtype=torch.long, device=device)

    def loss_fn(ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        lp = torch.log_softmax(logits[0, :-1, :vocab_size].double(), dim=-1)
        lp = lp.gather(1, ids[0, 1:].unsqueeze(1)).flatten()
        return logits.sum() * 0.0, {"logprobs": lp}

    def forward_step(data_iterator: Iterator[torch.Tensor], model: Any) -> tuple[Any, Any]:
        ids = next(data_iterator)
        pos = torch.arange(length, device=device).unsqueeze(0)
        return model(ids, pos, attention_mask=None), partial(loss_fn, ids)

    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        iters = [batches() for _ in models]
        with megatron_scope():
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iters if len(models) > 1 else iters[0],
                model=models if len(models) > 1 else models[0],
                num_microbatches=num_mb,
                seq_length=length,
                micro_batch_size=1,
                forward_only=True,
            )
    finally:
        for m, t in zip(models, was_training, strict=True):
            m.train(t)
    if pp == 1:
        result = torch.stack([o["logprobs"] for o in out[:num]])
    else:
        result = torch.empty(num, length - 1, dtype=torch.float64, device=device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            result.copy_(torch.stack([o["logprobs"] for o in out[:num]]))
        group = ps.get_pipeline_model_parallel_group()
        last = dist.get_process_group_ranks(group)[-1]
        dist.broadcast(result, src=last, group=group)
    return list(result.cpu().unbind(0))


def compare(engine: list[torch.Tensor], trainer: list[torch.Tensor]) -> tuple[float, float]:
    diff = torch.cat([(a - b).abs() for a, b in zip(engine, trainer, strict=True)])
    return float(diff.mean()), float(diff.max())


async def _score(
    e: Engine, probe: list[list[int]], version: str | None
) -> list[torch.Tensor] | None:
    """``e``'s probe logprobs; None when, with ``version``, it is not on that version before
    and after the probe, or did not answer it."""
    if version is None:
        return await engine_logprobs(e.client, probe)
    before = await e.client.weight_version()
    if before != version:
        log.warning("parity: %s reports version %s, not %s; not scored", e.url, before, version)
        return None
    try:
        found = await engine_logprobs(e.client, probe)
    except EngineUnavailableError as ex:
        log.warning("parity: %s did not answer the probe (%s); not scored", e.url, ex)
        return None
    after = await e.client.weight_version()
    if after != version:
        log.warning("parity: %s went to version %s during the probe; not scored", e.url, after)
        return None
    return found


async def score_engines(
    engines: list[Engine], probe: list[list[int]], version: str | None
) -> list[list[torch.Tensor] | None]:
    """Every engine's probe logprobs at once (None: not scored, see :func:`_score`)."""
    return list(await asyncio.gather(*(_score(e, probe, version) for e in engines)))


def verdict(
    cfg: SyncConfig,
    ours: list[torch.Tensor],
    scored: list[list[torch.Tensor] | None],
    version: str | None,
) -> dict[str, float]:
    """The check's metrics from the trainer's and the engines' logprobs; above
    ``sync.max_logprob_diff``, :class:`ParityError` (``sync.strict``) or a warning."""
    theirs = [t for t in scored if t is not None]
    skipped = {"sync/parity_skipped": float(len(scored) - len(theirs))} if version else {}
    if not theirs:
        return skipped
    stats = [compare(t, ours) for t in theirs]
    mean = sum(s[0] for s in stats) / len(stats)
    worst = max(s[1] for s in stats)
    if mean > cfg.max_logprob_diff:
        msg = (
            f"engine/trainer logprob mismatch after sync: mean {mean:.3g}, max {worst:.3g} "
            f"> sync.max_logprob_diff {cfg.max_logprob_diff}; check the HF mapping, the "
            "dtype (sync.dtype) and the engine's model config"
        )
        if cfg.strict:
            raise ParityError(msg)
        log.warning(msg)
    return {"sync/logprob_abs_diff_mean": mean, "sync/logprob_abs_diff_max": worst, **skipped}
