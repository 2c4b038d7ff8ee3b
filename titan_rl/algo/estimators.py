"""The advantage estimators and what each needs: the one table that the config's choices
(``algo.advantage_estimator``), its checks and the preflight warnings read.

An estimator whose baseline is its prompt's group (``group_baseline``) compares the samples
of one prompt: with ``rollout.n_samples_per_prompt=1`` every reward equals its baseline and
the reward never reaches an advantage (all zero, or only the KL penalty), and with
``rollout.temperature=0`` every sample of a group is the same greedy answer (the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator's properties, as its branch of compute_advantages has them."""

    #: the baseline is the mean (or leave-one-out mean) of the prompt's group
    group_baseline: bool
    #: what it computes, in a few words (for error messages and docs)
    summary: str


#: every estimator algo.advantage_estimator accepts, in the order the config lists them
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(True, "group-centred reward, divided by the group std"),
    "dr_grpo": Estimator(True, "group-centred reward (Dr. GRPO: no std)"),
    "gspo": Estimator(True, "grpo advantages, a sequence-level ratio in the loss"),
    "rloo": Estimator(True, "reward minus the mean of the group's other samples"),
    "reinforce_plus_plus": Estimator(False, "discounted token returns, whitened over the batch"),
    "reinforce_plus_plus_baseline": Estimator(
        True, "group-centred reward, whitened over the batch"
    ),
}

#: algo.advantage_estimator's type: the table's names
AdvantageEstimator = Literal[tuple(ESTIMATORS)]  # type: ignore[valid-type]

#: the estimators that compare the samples of one prompt (need n_samples_per_prompt >= 2)
GROUP_ESTIMATORS: tuple[str, ...] = tuple(n for n, e in ESTIMATORS.items() if e.group_baseline)


def group_size_problem(estimator: str, n_samples_per_prompt: int) -> str | None:
    """Why ``estimator`` cannot learn with ``n_samples_per_prompt`` samples per prompt
    (naming both keys), or None."""
    if ESTIMATORS[estimator].group_baseline and n_samples_per_prompt < 2:
        return (
            f"algo.advantage_estimator={estimator} compares the samples of a prompt (its "
            f"baseline is the group's): with rollout.n_samples_per_prompt="
            f"{n_samples_per_prompt} every reward equals its baseline and none reaches an "
            "advantage; set rollout.n_samples_per_prompt >= 2, or "
            "algo.advantage_estimator=reinforce_plus_plus (a batch baseline)"
        )
    return None
