"""Score responses: exact match, math-verify or a custom function, plus a format reward.

A custom function's value is checked where it enters: only a number finite in float32 (the
trainer's dtype: ``1e39`` is inf there) or a bool is a score (``"1"`` is not 1.0, NaN is not a
score), and a dict's ``correct`` (or ``acc``) must be a bool (or 0 / 1): ``"False"`` is not
False. Anything else is an InvalidRewardError naming ``reward.custom_path``, the field, the
value and the sample.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from titan_rl.rewards.config import RewardConfig
from titan_rl.rewards.errors import InvalidRewardError
from titan_rl.rewards.math_answer import math_reward


def first_line_answer(response: str, stop_strings: Sequence[str] = ()) -> str:
    """The response cut at the first stop string, then its first non-blank line, stripped."""
    cut = len(response)
    for s in stop_strings:
        i = response.find(s) if s else -1
        if i != -1:
            cut = min(cut, i)
    return response[:cut].strip().split("\n", 1)[0].strip()


def exact_match(response: str, label: str, stop_strings: Sequence[str] = ()) -> bool:
    """The first line of the response equals the label (both stripped)."""
    return first_line_answer(response, stop_strings) == str(label).strip()


@dataclass
class RewardResult:
    """One sample's score and what it was made of (for metrics such as accuracy)."""

    score: float
    #: the answer was right (None for a custom reward that does not say).
    correct: bool | None
    well_formed: bool | None
    extra: dict[str, Any] = field(default_factory=dict)
    #: "scored"; "timeout": the call ran past reward.timeout_s; "invalid": the reward was not
    #: a bool or a number finite in float32, or its ``correct`` not a bool, and
    #: reward.on_invalid=drop (see titan_rl.rewards.pool).
    status: Literal["scored", "timeout", "invalid"] = "scored"

    @property
    def is_correct(self) -> bool:
        """Right as the reward says (``correct``), else a full score (``score >= 1``)."""
        return self.correct if self.correct is not None else self.score >= 1.0


def _short(text: Any, limit: int = 80) -> str:
    s = str(text)
    return repr(s if len(s) <= limit else s[:limit] + "...")


def describe_sample(prompt: str, response: str, label: Any) -> str:
    """A sample as error messages name it: prompt, response and label, shortened."""
    return f"the sample with prompt {_short(prompt)}, response {_short(response)}, label {label!r}"


#: the largest magnitude a score may have: the trainer holds rewards in float32
FLOAT32_MAX = float(np.finfo(np.float32).max)


def finite_in_float32(x: float) -> bool:
    """``x`` is finite once cast to float32 (the trainer's dtype), as torch would cast it:
    values up to half an ulp past the largest float32 round down to it."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(x)))


#: what an invalid-reward error tells the user to do (the main job's reward keys)
FIX_ADVICE = "fix the function, or set reward.on_invalid=drop to leave such samples out of the loss"


def checked_score(
    value: Any, where: str, sample: str, field: str | None = None, advice: str = FIX_ADVICE
) -> float:
    """``value`` as a float when it is a bool or a number finite in float32; else
    InvalidRewardError naming ``where`` (the config key), the dict ``field`` the value came
    from (if any), the value and ``sample``, ending with ``advice``."""
    if isinstance(value, numbers.Real | np.bool_) and not isinstance(value, str):
        try:
            score = float(value)
        except (OverflowError, ValueError):
            score = math.nan
        if math.isfinite(score) and finite_in_float32(score):
            return score
    raise InvalidRewardError(
        f"{where} returned {_field_of(field)}{value!r} ({type(value).__name__}) for {sample}: "
        "a reward must be a bool or a number finite in float32 (|x| <= "
        f"{FLOAT32_MAX:.4g}); {advice}"
    )


def checked_correct(value: Any, where: str, sample: str, field: str) -> bool | None:
    """A dict's ``correct`` / ``acc`` (``field``) as a bool: a bool, or a number that is
    exactly 0 or 1; None: not said. Anything else (``"False"``, 0.5, a list) is an
    InvalidRewardError naming ``where``, the field, the value and ``sample`` (``bool("False")``
    is True: taken as is, it would count a wrong answer as right)."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, numbers.Real) and value in (0, 1):
        return bool(value)
    raise InvalidRewardError(
        f"{where} returned {_field_of(field)}{value!r} ({type(value).__name__}) for {sample}: "
        f"'{field}' must be a bool (or 0 / 1); fix the function, or set reward.on_invalid=drop "
        "to leave such samples out of the loss"
    )


def _field_of(field: str | None) -> str:
    return "" if field is None else f"'{field}': "


def _field(sample: Any, name: str, default: Any = None) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name, default)
    return getattr(sample, name, default)


class RewardScorer:
    """Scores samples under a :class:`RewardConfig`; one instance per process, reusable."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self._pattern = re.compile(cfg.format_pattern, re.DOTALL) if cfg.format_pattern else None
        self._custom = cfg.load_custom()
        #: runs ``async def`` custom rewards (one loop, so their clients can be reused)
        self._loop: asyncio.AbstractEventLoop | None = None

    def warm_up(self) -> None:
        """Import what the first call would (math-verify pulls in sympy: seconds)."""
        if self.cfg.type == "math_verify":
            import math_verify  # noqa: F401

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _call_custom(self, prompt: str, response: str, label: str, metadata: dict) -> Any:
        """The custom function's value; an ``async def`` one runs on this scorer's own loop,
        so a thread running an event loop cannot score it (the RewardPool's workers can)."""
        out = self._custom(prompt, response, label, metadata)  # type: ignore[misc]
        if inspect.isawaitable(out):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            out = self._loop.run_until_complete(out)
        return out

    def score_one(
        self, prompt: str, response: str, label: Any, metadata: dict | None = None
    ) -> RewardResult:
        cfg = self.cfg
        label_s = "" if label is None else str(label)
        extra: dict[str, Any] = {}
        if self._custom is not None:
            where = f"reward.custom_path {cfg.custom_path}"
            sample = describe_sample(prompt, response, label)
            out = self._call_custom(prompt, response, label_s, dict(metadata or {}))
            if isinstance(out, Mapping):
                key = "score" if "score" in out else "reward" if "reward" in out else None
                if key is None:
                    raise InvalidRewardError(
                        f"{where} returned a dict without 'score' for {sample}: "
                        f"{sorted(map(str, out))}"
                    )
                extra = {k: v for k, v in out.items() if k != key}
                base = checked_score(out[key], where, sample, key)
                said = "correct" if "correct" in extra else "acc"
                correct = checked_correct(extra.get(said), where, sample, said)
            else:
                base = checked_score(out, where, sample)
                correct = None
            well_formed = None
        elif cfg.type == "exact_match":
            answer = first_line_answer(response, cfg.stop_strings)
            correct = label is not None and answer == label_s.strip()
            well_formed = bool(answer)
            base = float(correct)
        else:
            correct, well_formed = (
                math_reward(response, label_s, cfg.timeout_s)
                if label is not None
                else (False, False)
            )
            base = float(correct)
        if self._pattern is not None:
            well_formed = self._pattern.search(response) is not None
        score = base
        if cfg.format_reward != 0.0 and well_formed:
            score += cfg.format_reward
            if self._custom is not None and not finite_in_float32(score):
                raise InvalidRewardError(
                    f"{where} returned {base!r} for {sample}: with reward.format_reward "
                    f"{cfg.format_reward!r} the score {score!r} is not finite in float32; "
                    "fix the function, or set reward.on_invalid=drop to leave such samples "
                    "out of the loss"
                )
        return RewardResult(score=score, correct=correct, well_formed=well_formed, extra=extra)

    def score_details(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict | None] | None = None,
    ) -> list[RewardResult]:
        if not len(prompts) == len(responses) == len(labels):
            raise ValueError(
                f"{len(prompts)} prompts, {len(responses)} responses and {len(labels)} labels"
            )
        metas = metadatas if metadatas is not None else [None] * len(prompts)
        return [
            self.score_one(p, r, lab, m)
            for p, r, lab, m in zip(prompts, responses, labels, metas, strict=True)
        ]

    def score_batch(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict | None] | None = None,
    ) -> list[float]:
        """Scores of parallel lists of prompts, responses, labels (and metadata dicts)."""
        return [r.score for r in self.score_details(prompts, responses, labels, metadatas)]

    def score_samples(self, samples: Sequence[Any]) -> list[RewardResult]:
        """Results of samples with ``prompt``, ``response``, ``label``, ``metadata``
        (attributes or mapping keys)."""
        return self.score_details(
            [_field(s, "prompt", "") for s in samples],
            [_field(s, "response", "") for s in samples],
            [_field(s, "label") for s in samples],
            [_field(s, "metadata") for s in samples],
        )

    def score(self, samples: Sequence[Any]) -> list[float]:
        """Scores of samples (see :meth:`score_samples`)."""
        return [r.score for r in self.score_samples(samples)]
