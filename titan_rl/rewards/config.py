"""Typed config of the reward (YAML section ``reward``)."""

from __future__ import annotations

import re
from typing import Literal

import numpy as np
from pydantic import Field, PositiveInt, ValidationInfo, field_validator, model_validator

from titan_core.config import Section
from titan_rl.rewards.custom import CustomRewardFn, load_custom_reward, split_custom_path

#: end-of-text markers an exact-match answer is cut at (besides the first newline).
DEFAULT_STOP_STRINGS = ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<eos>"]


class RewardConfig(Section):
    """How a response is scored against its label.

    exact_match: the response's first line (cut at any of ``stop_strings``), stripped, equals
    the stripped label (the arithmetic default). math_verify: a ``\\boxed{}`` answer, else a
    final "answer is X", else the last number, compared to the label with math-verify.
    custom: ``custom_path = "module:function"`` (or ``"path/to/file.py:function"``) called as
    ``fn(prompt, response, label, metadata) -> float | dict`` (a dict carries ``"score"``,
    and may carry ``"correct"`` for accuracy metrics), a plain or an ``async def`` function;
    a score must be a bool or a number finite in float32, a ``correct`` a bool (or 0 / 1).
    ``format_reward`` is added to the score of a well-formed response: one matching
    ``format_pattern`` (``re.search``, DOTALL) or, without a pattern, one whose answer could
    be extracted. Use a negative weight with a pattern that matches bad output for a penalty.
    """

    #: how a response is scored (see above).
    type: Literal["exact_match", "math_verify", "custom"] = "exact_match"
    #: custom: the function, ``module:function`` or ``path/to/file.py:function``. Validation
    #: checks its form only; the GRPO job imports it before anything starts (a missing module
    #: is an error then), and each reward worker once.
    custom_path: str | None = None
    #: added to the score of a well-formed response (see above).
    format_reward: float = Field(0.0, allow_inf_nan=False)
    #: what a well-formed response matches (``re.search``, DOTALL); None: any whose answer
    #: could be extracted.
    format_pattern: str | None = None
    #: exact_match: the answer is cut at the first of these (and at the first newline).
    stop_strings: list[str] = Field(default_factory=lambda: list(DEFAULT_STOP_STRINGS))
    #: wall-clock seconds one sample's reward call may run in a reward worker (custom and
    #: math_verify rewards, and any with a format_pattern; a plain exact match is a string
    #: comparison, scored inline). Past it the worker is killed and replaced, and the sample
    #: scores ``timeout_score`` (counted in ``reward/timeouts``).
    timeout_s: float = Field(5.0, gt=0.0, allow_inf_nan=False)
    #: the score of a sample whose reward call ran past ``timeout_s``.
    timeout_score: float = Field(0.0, allow_inf_nan=False)
    #: a reward that is not a bool or a number finite in float32 (NaN, inf, 1e39, None, a
    #: string), or whose ``correct`` is not a bool (``"False"``): "error" stops the run
    #: naming the field, the value and the sample; "drop" leaves the sample out of the loss
    #: (its group baseline is its group's valid rewards) and counts it in ``reward/invalid``.
    on_invalid: Literal["error", "drop"] = "error"
    #: when more than ``max_timeout_share`` of a step's (or an evaluation's) samples time out:
    #: "warn" prints a warning line naming the count and goes on; "stop" stops the run
    #: naming this key (a reward that times out on every sample teaches nothing).
    on_timeouts: Literal["warn", "stop"] = "warn"
    #: the largest share of a step's (or an evaluation's) samples whose reward call may
    #: time out before ``on_timeouts`` acts; 1: never.
    max_timeout_share: float = Field(0.5, ge=0.0, le=1.0)
    #: worker processes scoring rewards concurrently, off the driver's event loop.
    num_workers: PositiveInt = 4

    @field_validator("format_pattern")
    @classmethod
    def _check_pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"reward.format_pattern is not a valid regex: {e}") from None
        return v

    @field_validator("format_reward", "timeout_score")
    @classmethod
    def _check_float32(cls, v: float, info: ValidationInfo) -> float:
        with np.errstate(over="ignore"):
            if not np.isfinite(np.float32(v)):
                raise ValueError(
                    f"reward.{info.field_name}={v!r} is not finite in float32 (the trainer's "
                    f"rewards): keep |x| <= {float(np.finfo(np.float32).max):.4g}"
                )
        return v

    @field_validator("custom_path")
    @classmethod
    def _check_custom_path(cls, v: str | None) -> str | None:
        if v is not None:
            split_custom_path(v)  # its form; importing it is load_custom()'s
        return v

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if self.type == "custom" and self.custom_path is None:
            raise ValueError(
                "reward.custom_path is required when reward.type is 'custom' "
                "(e.g. reward.custom_path=my_pkg.rewards:score)"
            )
        if self.type != "custom" and self.custom_path is not None:
            raise ValueError(
                f"reward.custom_path is set but reward.type is {self.type!r}; "
                "set reward.type=custom to use it"
            )
        if self.type == "custom" and self.format_reward != 0.0 and self.format_pattern is None:
            raise ValueError(
                "reward.format_pattern is required for reward.format_reward with a custom reward"
            )
        return self

    def load_custom(self) -> CustomRewardFn | None:
        """The ``custom_path`` function, imported (None unless ``type`` is custom); ValueError
        naming ``reward.custom_path`` when it cannot be imported or called so."""
        return load_custom_reward(self.custom_path) if self.custom_path else None
