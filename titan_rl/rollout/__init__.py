"""Rollout: the engine-client seam (``engine_api``, ``engine_clients``), the SGLang HTTP
client (one client for SGLang, sglang-router and the CPU engine), groups, filters."""

from titan_rl.rollout.client import (
    SGLangClient,
    SGLangError,
    SGLangRequestError,
    SGLangUnavailableError,
    WeightUpdateError,
)
from titan_rl.rollout.engine_api import (
    ClientOptions,
    EngineClient,
    EngineError,
    EngineUnavailableError,
    GenerateOutput,
    RetryPolicy,
)
from titan_rl.rollout.engine_clients import make_engine_client, register_engine_client
from titan_rl.rollout.tensor_payload import serialize_named_tensors

__all__ = [
    "ClientOptions",
    "EngineClient",
    "EngineError",
    "EngineUnavailableError",
    "GenerateOutput",
    "RetryPolicy",
    "SGLangClient",
    "SGLangError",
    "SGLangRequestError",
    "SGLangUnavailableError",
    "WeightUpdateError",
    "make_engine_client",
    "register_engine_client",
    "serialize_named_tensors",
]
