"""Policy-gradient loss: PPO clip (clip-higher, dual clip), GSPO, KL loss, entropy bonus, and
the rollout corrections (TIS, MIS, IcePop: ``rollout_correction``).

Shapes: every per-token tensor is ``[B, T]`` over response positions, ``response_mask`` is 1
on the tokens that count. ``logprobs`` carries the gradient; everything else is treated as a
constant.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_rl.algo.config import AlgoConfig, KLKind, LossAggMode
from titan_rl.algo.estimators import ESTIMATORS
from titan_rl.algo.rollout_correction import LOG_RATIO_CLAMP, rollout_correction

#: the GSPO sequence log-ratio is clamped at this value from above (verl uses 10).
SEQ_LOG_RATIO_MAX = 10.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind) -> Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3).

    k1 = lp - ref; k2 = (lp - ref)^2 / 2; k3 = exp(ref - lp) - (ref - lp) - 1;
    low_var_kl is k3 with the log-ratio clamped to [-20, 20] and the result to [-10, 10].
    """
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind == "k3":
        d = ref_logprobs - logprobs
        return torch.exp(d) - d - 1
    if kind == "low_var_kl":
        d = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(d) - d - 1, -10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r} (k1, k2, k3, low_var_kl)")


def aggregate(
    x: Tensor,
    mask: Tensor,
    mode: LossAggMode,
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> Tensor:
    """Reduce a per-token tensor to a scalar.

    token_mean: sum over all valid tokens / token count; seq_mean_token_mean: mean of each
    sequence's token mean; seq_mean_token_sum: mean of each sequence's token sum (Dr. GRPO).
    ``total_tokens`` / ``total_seqs`` replace the local denominators with global-batch counts so
    that summing the results of all microbatches and data-parallel ranks gives the global value.
    """
    if mode == "token_mean" and total_tokens is None and total_seqs is not None:
        raise ValueError("loss_agg_mode token_mean needs total_tokens, got only total_seqs")
    if mode != "token_mean" and total_seqs is None and total_tokens is not None:
        raise ValueError(f"loss_agg_mode {mode} needs total_seqs, got only total_tokens")
    m = mask.to(x.dtype)
    if mode == "token_mean":
        denom = total_tokens if total_tokens is not None else m.sum().clamp(min=1.0)
        return (x * m).sum() / denom
    lengths = m.sum(dim=1)
    seq_sum = (x * m).sum(dim=1)
    if mode == "seq_mean_token_mean":
        per_seq = seq_sum / lengths.clamp(min=1.0)
    elif mode == "seq_mean_token_sum":
        per_seq = seq_sum
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    denom = total_seqs if total_seqs is not None else (lengths > 0).sum().clamp(min=1)
    return per_seq.sum() / denom


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cfg: AlgoConfig,
    *,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip policy loss (+ KL loss, - entropy bonus) and metrics as python floats.

    The clipped loss per token is ``max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high))``,
    capped at ``-A * eps_clip_c`` where ``A < 0`` (dual clip). For gspo the ratio is the
    sequence ratio ``exp(mean_t(lp - old_lp))`` in value, with each token's gradient flowing
    through its own ``lp`` (GSPO-token straight-through, which equals GSPO for equal
    advantages over a sequence). With ``use_tis`` the per-token policy-gradient loss is scaled
    by ``clip(exp(old_lp - rollout_lp), tis_clip_low, tis_clip)`` (the KL and entropy terms
    are not), IcePop scales it by the ratio or 0, and the tokens MIS drops leave every term
    and the normaliser: ``total_tokens`` / ``total_seqs`` must then count the tokens and
    sequences left (``rollout_correction(...).mask``). Metrics are means over this call's
    tokens, independent of ``total_*``.
    """
    correction = None
    if rollout_logprobs is not None:
        correction = rollout_correction(old_logprobs, rollout_logprobs, response_mask, cfg)
        mask = correction.mask.to(logprobs.dtype)
    else:
        switch = next((k for k in ("use_tis", "use_rs", "use_icepop") if getattr(cfg, k)), None)
        if switch is not None:
            raise ValueError(f"algo.{switch} is true but no rollout_logprobs were given")
        mask = response_mask.to(logprobs.dtype)
    agg = {"mode": cfg.loss_agg_mode, "total_tokens": total_tokens, "total_seqs": total_seqs}
    old = old_logprobs.detach()
    adv = advantages.detach().to(logprobs.dtype)

    log_ratio = logprobs - old
    if ESTIMATORS[cfg.advantage_estimator].sequence_ratio:  # GSPO
        lengths = mask.sum(dim=1).clamp(min=1.0)
        seq_log_ratio = ((log_ratio.detach() * mask).sum(dim=1) / lengths).clamp(
            max=SEQ_LOG_RATIO_MAX
        )
        log_ratio = logprobs - logprobs.detach() + seq_log_ratio[:, None]
    else:
        log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
    clip1 = torch.maximum(pg1, pg2)
    pg = clip1
    lower_clipped = torch.zeros_like(mask)
    if cfg.eps_clip_c is not None:
        pg3 = -adv * cfg.eps_clip_c
        pg = torch.where(adv < 0, torch.minimum(pg3, clip1), clip1)
        lower_clipped = ((clip1 > pg3) & (adv < 0)).to(mask.dtype)

    stats: dict[str, Tensor] = {
        "pg_clipfrac": _masked_mean((pg2 > pg1).to(mask.dtype), mask),
        "pg_clipfrac_lower": _masked_mean(lower_clipped, mask),
        "ppo_kl": _masked_mean(-log_ratio.detach(), mask),
        "ratio_mean": _masked_mean(ratio.detach(), mask),
    }

    if correction is not None:
        diff = (old - rollout_logprobs.detach()).abs()
        stats["train_rollout_logprob_abs_diff"] = _masked_mean(diff, response_mask)
        stats.update(correction.stats)
        pg = pg * correction.weight.to(pg.dtype)

    pg_loss = aggregate(pg, mask, **agg)
    loss = pg_loss
    stats["pg_loss"] = _masked_mean(pg.detach(), mask)

    if cfg.use_kl_loss:
        if ref_logprobs is None:
            raise ValueError("algo.use_kl_loss is true but no ref_logprobs were given")
        kl = kl_penalty(logprobs, ref_logprobs.detach(), cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * aggregate(kl, mask, **agg)
        stats["kl_loss"] = _masked_mean(kl.detach(), mask)

    if entropy is not None:
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * aggregate(entropy, mask, **agg)
        stats["entropy"] = _masked_mean(entropy.detach(), mask)
    elif cfg.entropy_coef != 0.0:
        raise ValueError("algo.entropy_coef is not 0 but no entropy was given")

    stats["loss"] = loss
    names = list(stats)
    values = torch.stack([stats[k].detach().float() for k in names]).tolist()  # one sync
    return loss, dict(zip(names, values, strict=True))
