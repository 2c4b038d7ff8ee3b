"""Typed config of the RL algorithm (YAML section ``algo``): estimator, PPO-clip loss, KL, TIS."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from titan_core.config import Section

AdvantageEstimator = Literal[
    "grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"
]
LossAggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]


class AlgoConfig(Section):
    """Advantage estimator and policy-loss settings (slime/verl names and conventions)."""

    #: dr_grpo drops the std and is meant to pair with loss_agg_mode seq_mean_token_sum;
    #: gspo uses grpo advantages with a sequence-level ratio in the loss.
    advantage_estimator: AdvantageEstimator = "grpo"
    #: grpo/gspo: divide the group-centred reward by the group std (False: Dr. GRPO-like).
    normalize_advantage_std: bool = True
    #: PPO clip range: ratio kept in [1 - eps_clip, 1 + eps_clip_high].
    eps_clip: float = Field(0.2, gt=0.0, lt=1.0)
    #: clip-higher (DAPO); None: same as eps_clip.
    eps_clip_high: float | None = Field(None, gt=0.0)
    #: dual clip for negative advantages: the loss is capped at -A * eps_clip_c; None: off.
    eps_clip_c: float | None = Field(None, gt=1.0)
    loss_agg_mode: LossAggMode = "token_mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: KLKind = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_in_reward_coef: float = Field(0.0, ge=0.0)
    #: loss -= entropy_coef * entropy (a bonus for exploration when positive).
    entropy_coef: float = 0.0
    #: truncated importance sampling against the rollout engine's logprobs (the off-policy
    #: correction). None: on with rollout.async=true (one-step off-policy), off otherwise
    #: (the GRPO loop decides); true / false: as set.
    use_tis: bool | None = None
    tis_clip: float = Field(2.0, gt=0.0)
    #: discount of reinforce_plus_plus token-level returns.
    gamma: float = Field(1.0, ge=0.0, le=1.0)

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used (eps_clip_high, or eps_clip when unset)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        if not self.use_kl_in_reward and self.kl_in_reward_coef > 0.0:
            raise ValueError(
                "algo.kl_in_reward_coef is > 0 but algo.use_kl_in_reward is false; "
                "set algo.use_kl_in_reward=true or algo.kl_in_reward_coef=0"
            )
        if not self.use_kl_loss and self.kl_loss_coef > 0.0:
            raise ValueError(
                "algo.kl_loss_coef is > 0 but algo.use_kl_loss is false; "
                "set algo.use_kl_loss=true or algo.kl_loss_coef=0"
            )
        return self
