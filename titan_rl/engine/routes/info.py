"""Health and information: ``/health``, ``/health_generate``, model, server and weight info."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from titan_rl.engine.dispatch import run_sequences
from titan_rl.engine.routes.common import ORJSONResponse
from titan_rl.engine.sampling import parse_sampling_params
from titan_rl.engine.state import ServerState, State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    return Response(status_code=200 if state.engine.alive else 503)


@router.get("/health_generate")
async def health_generate(state: State) -> Response:
    """200 once a one-token generation succeeds (or while paused or released, when it cannot)."""
    engine = state.engine
    if not engine.alive:
        return Response(status_code=503)
    if engine.paused or engine.memory.released:
        return Response(status_code=200)
    try:
        params = parse_sampling_params({"max_new_tokens": 1, "temperature": 0}, engine.vocab_size)
        probe = engine.make_sequence([0], params, rid=None)
        await asyncio.wait_for(run_sequences(engine, [probe]), 20)
    except Exception:
        return Response(status_code=503)
    return Response(status_code=200)


def model_info(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": engine.config.model_type,
        "architectures": list(getattr(engine.config, "architectures", None) or []),
        "served_model_name": state.served_model_name or engine.model_path,
    }


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(state: State) -> ORJSONResponse:
    return ORJSONResponse(model_info(state))


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(state: State) -> ORJSONResponse:
    engine = state.engine
    return ORJSONResponse(
        {
            **model_info(state),
            "engine": "titan_rl.engine",
            "device": "cpu",
            "tp_size": engine.tp_size,
            "dp_size": 1,
            "context_length": engine.context_length,
            "max_running_requests": engine.max_running,
            "max_queued_requests": engine.max_queued,
            # no prefix (radix) cache: a request's KV lives as long as the request, so a
            # weight update has no cached KV to flush (SGLang's server argument of this name)
            "disable_radix_cache": True,
            "num_queued_reqs": engine.num_queued(),
            "skip_tokenizer_init": engine.tokenizer is None,
            "num_running_reqs": engine.num_running(),
            "paused": engine.paused,
            "memory_released": engine.memory.released,
            "memory_released_tags": sorted(engine.memory.released_tags),
            "memory_release_count": engine.memory.releases,
            "memory_resume_count": engine.memory.resumes,
            "weight_bytes": engine.runner.weight_bytes(),
            "decode_steps": engine.steps,
            "generated_tokens": engine.generated_tokens,
            "version": "titan-builtin",
        }
    )


@router.get("/get_weight_version")
@router.get("/weight_version")
async def get_weight_version(state: State) -> ORJSONResponse:
    return ORJSONResponse({"weight_version": state.engine.weight_version})
