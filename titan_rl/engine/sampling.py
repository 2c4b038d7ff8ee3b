"""Sampling parameters (SGLang's names, defaults and ranges) and the batched sampler.

Logprob definition, read from SGLang's ``srt/layers/sampler.py``: the logprob reported for a
sampled token is ``log(softmax(logits / temperature))`` at that token, taken after logit bias
and penalties but *before* top-k / top-p / min-p filtering (no renormalisation), clamped to
the dtype's finite minimum. Greedy rows (temperature < 1e-6) report ``log_softmax(logits)``.
With ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` in the environment SGLang reports the unscaled
``log_softmax(logits)`` instead; this engine honours the same variable.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from titan_rl.engine.validation import RequestError, context_vocab_size, invalid, parse

GREEDY_EPS = 1e-6

__all__ = ["BatchSampler", "RequestError", "SamplingParams", "parse_sampling_params", "sample"]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


RETURN_ORIGINAL_LOGPROB = _env_flag("SGLANG_RETURN_ORIGINAL_LOGPROB")

_UNSUPPORTED = {
    "json_schema": "constrained decoding (json_schema) is not supported by the built-in CPU engine",
    "regex": "constrained decoding (regex) is not supported by the built-in CPU engine",
    "ebnf": "constrained decoding (ebnf) is not supported by the built-in CPU engine",
    "structural_tag": "structural_tag is not supported by the built-in CPU engine",
    "stop_regex": "stop_regex is not supported by the built-in CPU engine; use stop or stop_token_ids",
}


class SamplingParams(BaseModel):
    """One request's ``sampling_params``; unknown keys are rejected as SGLang 0.5.23 does.

    Token ids are checked against the vocabulary when the validation context holds
    ``vocab_size`` (see :func:`parse_sampling_params`).
    ``sampling_seed`` makes a request reproducible whatever else shares the batch; copy ``i``
    of a request with ``n`` > 1 uses ``sampling_seed + i`` so the copies differ.
    """

    model_config = ConfigDict(extra="forbid", frozen=False)

    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    sampling_seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    n: int = Field(1, ge=1, le=128)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (whole vocabulary) or at least 1")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        vocab = context_vocab_size(info)
        outside = [t for t in v or [] if vocab is not None and t >= vocab]
        if outside:
            raise invalid(f"{outside[0]} is outside the vocabulary (size {vocab})")
        return v

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise invalid(_UNSUPPORTED[str(info.field_name)])
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(
        cls, v: dict[str, float] | None, info: ValidationInfo
    ) -> dict[str, float] | None:
        vocab = context_vocab_size(info)
        for key, bias in (v or {}).items():
            if not -1e4 <= bias <= 1e4:
                raise invalid(f"{bias} for token {key} is outside [-1e4, 1e4]")
            try:
                tid = int(key)
            except ValueError:
                raise invalid(f"key {key!r} is not a token id") from None
            if tid < 0 or (vocab is not None and tid >= vocab):
                raise invalid(f"token {tid} is outside the vocabulary")
        return v

    @model_validator(mode="after")
    def _min_within_max(self) -> Self:
        if self.min_new_tokens > self.max_new_tokens:
            raise invalid(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


#: the message for a key :class:`SamplingParams` does not know
UNKNOWN_SAMPLING_PARAMETER = (
    f"unknown sampling parameter (supported: {', '.join(sorted(SamplingParams.model_fields))})"
)


def parse_sampling_params(
    raw: Any, vocab_size: int, where: str = "sampling_params"
) -> SamplingParams:
    """Validate one ``sampling_params`` dict; raise RequestError naming the bad key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"{where} must be a JSON object, got {type(raw).__name__}")
    return parse(
        SamplingParams,
        raw,
        context={"vocab_size": vocab_size},
        prefix=where,
        unknown=UNKNOWN_SAMPLING_PARAMETER,
    )


def _filter_probs(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero the probabilities top-k, top-p and min-p exclude (SGLang's torch fallback rule)."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab, device=probs.device).unsqueeze(0)
    drop = (cum - sorted_p) > top_p.unsqueeze(1)
    drop |= ranks >= top_k.unsqueeze(1)
    drop |= sorted_p < (sorted_p[:, :1] * min_p.unsqueeze(1))
    drop[:, 0] = False  # the most likely token always survives
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs)
    out.scatter_(1, idx, sorted_p)
    return out


#: the 32-bit mask; the hash runs on uint64 values below 2**32, so a product of two of them
#: stays below 2**64 and ``& _M32`` is the product mod 2**32
_M32 = np.uint64(0xFFFFFFFF)


def _mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer finalizer (xorshift-multiply, "lowbias32"), in place on ``x`` (uint64
    values below 2**32): each output bit depends on every input bit."""
    x ^= x >> np.uint64(16)
    x *= np.uint64(0x7FEB352D)
    x &= _M32
    x ^= x >> np.uint64(15)
    x *= np.uint64(0x846CA68B)
    x &= _M32
    x ^= x >> np.uint64(16)
    return x


def seed_keys(seeds: Sequence[int]) -> np.ndarray:
    """The per-row keys :func:`uniform_from_keys` draws from (seeds in [0, 2**63))."""
    s = np.asarray(seeds, dtype=np.uint64).reshape(-1)
    keys = _mix32((s & _M32) ^ np.uint64(0x9E3779B9))
    keys ^= s >> np.uint64(32)
    return _mix32(keys)


def uniform_from_keys(keys: np.ndarray, steps: Sequence[int]) -> torch.Tensor:
    """Draw ``steps[i]`` of the stream with key ``keys[i]`` (see :func:`seeded_uniform`):
    float64 in [0, 1)."""
    hi = _mix32(keys ^ (np.asarray(steps, dtype=np.uint64) & _M32))
    lo = _mix32(hi ^ np.uint64(0x85EBCA6B))
    bits = (hi << np.uint64(21)) + (lo >> np.uint64(11))  # 53 bits: exact in float64
    return torch.from_numpy(bits.astype(np.float64) / 2.0**53)


def seeded_uniform(seeds: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    """One uniform draw in [0, 1) per row, a function of (``seeds[i]``, ``steps[i]``) only
    (seeds in [0, 2**63), steps >= 0), with 53 random bits.

    A counter-based generator, as GPU engines seed their sampling: the draw for token ``k``
    of a seeded request does not depend on what else shares the batch or on earlier steps,
    and a whole batch is drawn in a few vectorised integer ops (a ``torch.Generator`` per
    row costs one multinomial call per row per step). The ops run in numpy: on a batch's
    few dozen rows each costs ~1 us there, ~5 us as a torch op.
    """
    return uniform_from_keys(seed_keys(seeds), steps)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token: the first whose cumulative probability exceeds ``u[i]`` of the row's
    total (so a token of probability 0 is never drawn)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int | None],
    steps: list[int],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids [B], logprobs [B, V] per SGLang's definition).

    Rows with a seed (``seeds[i]``: the request's ``sampling_seed``, plus ``i`` for copy ``i``
    of an ``n`` > 1 request) draw token ``steps[i]`` of their output from
    :func:`seeded_uniform`, so their samples do not depend on which other requests share the
    batch; the others draw from ``default_generator``.
    """
    return BatchSampler(default_generator).sample(logits, params, seeds, steps)


class _RowSettings:
    """A batch's per-row sampling settings as tensors, made once for its rows' ``params`` and
    ``seeds`` (a decode batch keeps its rows for many steps)."""

    def __init__(self, params: list[SamplingParams], seeds: list[int | None], vocab: int) -> None:
        self.params, self.seeds, self.vocab = list(params), list(seeds), vocab
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        greedy = temps < GREEDY_EPS
        #: the rows that sample (the others take the argmax); None: every row samples
        self.greedy: torch.Tensor | None = greedy if bool(greedy.any()) else None
        self.divisor = torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
        sampled = (~greedy).nonzero().flatten().tolist()
        self.sampled = sampled
        self.rows = torch.tensor(sampled, dtype=torch.long)
        top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in sampled])
        top_p = torch.tensor([params[i].top_p for i in sampled], dtype=torch.float32)
        min_p = torch.tensor([params[i].min_p for i in sampled], dtype=torch.float32)
        self.filters = None
        if bool((top_k < vocab).any() or (top_p < 1.0).any() or (min_p > 0).any()):
            self.filters = (top_k, top_p, min_p)
        #: positions (among the sampled rows) with a seed, and their keys
        self.seeded = [j for j, i in enumerate(sampled) if seeds[i] is not None]
        self.keys = seed_keys([seeds[sampled[j]] for j in self.seeded])
        #: every sampled row is seeded: the default generator is not drawn from
        self.all_seeded = len(self.seeded) == len(sampled)

    def fits(self, params: list[SamplingParams], seeds: list[int | None], vocab: int) -> bool:
        return (
            vocab == self.vocab
            and len(params) == len(self.params)
            and all(a is b for a, b in zip(params, self.params, strict=True))
            and seeds == self.seeds
        )


class BatchSampler:
    """:func:`sample` for an engine's batches: the per-row settings of the last batch are kept
    while the same rows come back (the same :class:`SamplingParams` objects and seeds), so a
    decode step only draws."""

    def __init__(self, default_generator: torch.Generator) -> None:
        self.default_generator = default_generator
        self._last: _RowSettings | None = None

    def _settings(
        self, params: list[SamplingParams], seeds: list[int | None], vocab: int
    ) -> _RowSettings:
        last = self._last
        if last is None or not last.fits(params, seeds, vocab):
            last = self._last = _RowSettings(params, seeds, vocab)
        return last

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int | None],
        steps: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`sample`."""
        logits = logits.float()
        bsz, vocab = logits.shape
        rs = self._settings(params, seeds, vocab)
        scaled = logits / rs.divisor
        if RETURN_ORIGINAL_LOGPROB:
            logprobs = torch.log_softmax(logits, dim=-1)
        else:
            logprobs = torch.log_softmax(scaled, dim=-1)
        logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
        greedy = rs.greedy
        if greedy is None:  # every row samples
            probs = torch.softmax(scaled, dim=-1)
        else:
            next_ids = torch.empty(bsz, dtype=torch.long)
            next_ids[greedy] = logits[greedy].argmax(dim=-1)
            if not rs.sampled:
                return next_ids, logprobs
            probs = torch.softmax(scaled[rs.rows], dim=-1)
        if rs.filters is not None:
            probs = _filter_probs(probs, *rs.filters)
        seeded_u = None
        if rs.seeded:  # unseeded batches skip the hash
            seeded_u = uniform_from_keys(rs.keys, [steps[rs.sampled[j]] for j in rs.seeded])
        if rs.all_seeded:
            u = seeded_u
        else:
            u = torch.rand(len(rs.sampled), dtype=torch.float64, generator=self.default_generator)
            if seeded_u is not None:
                u[rs.seeded] = seeded_u
        drawn = _inverse_cdf(probs, u)
        if greedy is None:
            return drawn, logprobs
        next_ids[rs.rows] = drawn
        return next_ids, logprobs
