"""Typed config of the RL algorithm (YAML section ``algo``): estimator, PPO-clip loss, KL,
and the rollout -> trainer corrections (TIS, MIS, IcePop)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from titan_core.config import Section
from titan_rl.algo.estimators import AdvantageEstimator

LossAggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
#: where an importance ratio is taken (slime's tis_level / rs_level): per token, per sequence
#: (the product of its tokens' ratios) or per sequence as their geometric mean.
CorrectionLevel = Literal["token", "sequence", "geometric"]


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
    #: (the GRPO loop decides); true / false: as set. slime / miles ``--use-tis``; verl
    #: ``rollout_is`` not null.
    use_tis: bool | None = None
    #: TIS weight kept in [tis_clip_low, tis_clip]: slime / miles ``--tis-clip`` and
    #: ``--tis-clip-low`` (slime's mis.yaml ``tis_upper_bound`` / ``tis_lower_bound``),
    #: verl ``rollout_is_threshold`` (verl has no lower bound: 0).
    tis_clip: float = Field(2.0, gt=0.0)
    tis_clip_low: float = Field(0.0, ge=0.0)
    #: slime mis.yaml ``tis_level``; verl ``rollout_is: token | sequence``.
    tis_level: CorrectionLevel = "token"
    #: MIS: drop the tokens (token) or whole sequences (sequence, geometric) whose ratio is
    #: outside [rs_lower_bound, rs_upper_bound], bounds included; dropped tokens leave the loss
    #: and its normaliser (KL and entropy terms too), as verl does. slime / miles mis.yaml
    #: ``use_rs`` / ``rs_level`` / ``rs_lower_bound`` / ``rs_upper_bound``; verl
    #: ``rollout_rs: token_k1 | seq_sum_k1 | seq_mean_k1`` (token / sequence / geometric)
    #: with ``rollout_rs_threshold: "lower_upper"``.
    use_rs: bool = False
    rs_level: CorrectionLevel = "token"
    #: None: 1 / rs_upper_bound (verl's default lower bound; slime's falls back to it too).
    rs_lower_bound: float | None = Field(None, ge=0.0)
    rs_upper_bound: float = Field(2.0, gt=0.0)
    #: IcePop: each token's policy-gradient term is scaled by its ratio where that is in
    #: [icepop_alpha, icepop_beta] (bounds included) and by 0 outside; the normaliser keeps
    #: every token, as in the IcePop paper and slime / miles' ``icepop_function``
    #: (``--custom-tis-function-path ...icepop_function --tis-clip-low A --tis-clip B``).
    #: It carries the IS weight itself, so it replaces TIS (use_tis=true with it is an error).
    use_icepop: bool = False
    #: the IcePop paper's values (Ring-1T).
    icepop_alpha: float = Field(0.5, ge=0.0)
    icepop_beta: float = Field(5.0, gt=0.0)
    #: discount of reinforce_plus_plus token-level returns.
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    #: routing replay (R3) for MoE models: the trainer's old-logprob, reference and policy
    #: forwards route each token to the experts the rollout engine routed it to (megatron-core's
    #: ``moe_enable_routing_replay``), so the update is on the rollout's experts. Turns
    #: ``rollout.return_routed_experts`` on. slime / miles ``--use-rollout-routing-replay``.
    routing_replay: bool = False
    #: true: the old logprobs (the PPO ratio's denominator) always come from a no-grad forward
    #: of their own before the update. false: with one update per batch (train.ppo_steps=1) the old
    #: policy is the one being trained, so the update's forward gives them (its logprobs,
    #: detached: ratio 1, as TRL's GRPOTrainer and verl do) and that forward is skipped,
    #: unless something needs them before the update (the KL in the reward, MIS, dropout:
    #: see ``titan_rl.trainer.policy.old_logprobs_forward_reason``). Both give the same step
    #: where the forward is deterministic.
    recompute_old_logprobs: bool = False

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used (eps_clip_high, or eps_clip when unset)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """The MIS bounds actually used (rs_lower_bound defaults to 1 / rs_upper_bound)."""
        low = 1.0 / self.rs_upper_bound if self.rs_lower_bound is None else self.rs_lower_bound
        return low, self.rs_upper_bound

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        rs_low = "rs_lower_bound"
        if self.rs_lower_bound is None:
            rs_low += " (unset: 1 / rs_upper_bound)"
        bounds = [
            ("tis_clip_low", self.tis_clip_low, "tis_clip", self.tis_clip),
            (rs_low, self.rs_bounds[0], "rs_upper_bound", self.rs_upper_bound),
            ("icepop_alpha", self.icepop_alpha, "icepop_beta", self.icepop_beta),
        ]
        for low_key, low, high_key, high in bounds:
            if low > high:
                raise ValueError(
                    f"algo.{low_key} = {low:g} is above algo.{high_key} = {high:g}; "
                    f"set algo.{low_key.split()[0]} <= algo.{high_key}"
                )
        if self.use_tis and self.use_icepop:
            raise ValueError(
                "algo.use_icepop and algo.use_tis are both true, but IcePop already weights "
                "each token by its importance ratio; set algo.use_tis=false"
            )
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
