"""Flow control and memory: flush, pause/continue, abort, release/resume memory occupation."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response

from titan_rl.engine.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
)
from titan_rl.engine.routes.common import ORJSONResponse, body
from titan_rl.engine.state import State

router = APIRouter()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(state: State) -> Response:
    if state.engine.num_in_flight() > 0:
        return PlainTextResponse(
            "Cache not flushed because there are pending requests; retry when idle",
            status_code=400,
        )
    return PlainTextResponse(
        "Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n"
    )


@router.post("/pause_generation")
async def pause_generation(
    req: Annotated[PauseGenerationReqInput, Depends(body(PauseGenerationReqInput))], state: State
) -> ORJSONResponse:
    engine = state.engine

    def pause() -> None:
        if req.mode == "abort":
            engine.abort(None, abort_all=True, message="aborted by pause_generation")
        engine.paused = True

    await state.on_engine(pause)
    return ORJSONResponse({"success": True, "message": "Generation paused."})


@router.post("/continue_generation")
async def continue_generation(
    _: Annotated[ContinueGenerationReqInput, Depends(body(ContinueGenerationReqInput))],
    state: State,
) -> ORJSONResponse:
    engine = state.engine

    def resume() -> None:
        engine.paused = False

    await state.on_engine(resume)
    return ORJSONResponse({"success": True, "message": "Generation continued."})


@router.post("/abort_request")
async def abort_request(
    req: Annotated[AbortReq, Depends(body(AbortReq))], state: State
) -> Response:
    engine = state.engine
    await state.on_engine(lambda: engine.abort(req.rid or None, abort_all=req.abort_all))
    return Response(status_code=200)


@router.post("/release_memory_occupation")
async def release_memory(
    req: Annotated[ReleaseMemoryOccupationReqInput, Depends(body(ReleaseMemoryOccupationReqInput))],
    state: State,
) -> ORJSONResponse:
    engine = state.engine
    await state.on_engine(lambda: engine.memory.release(req.tags))
    return ORJSONResponse(None)


@router.post("/resume_memory_occupation")
async def resume_memory(
    req: Annotated[ResumeMemoryOccupationReqInput, Depends(body(ResumeMemoryOccupationReqInput))],
    state: State,
) -> ORJSONResponse:
    engine = state.engine
    await state.on_engine(lambda: engine.memory.resume(req.tags))
    return ORJSONResponse(None)
