"""Rollout: the SGLang HTTP client (one client for SGLang, sglang-router and the CPU engine)."""

from titan_rl.rollout.client import (
    GenerateOutput,
    RetryPolicy,
    SGLangClient,
    SGLangError,
    SGLangRequestError,
    SGLangUnavailableError,
    WeightUpdateError,
)
from titan_rl.rollout.tensor_payload import serialize_named_tensors

__all__ = [
    "GenerateOutput",
    "RetryPolicy",
    "SGLangClient",
    "SGLangError",
    "SGLangRequestError",
    "SGLangUnavailableError",
    "WeightUpdateError",
    "serialize_named_tensors",
]
