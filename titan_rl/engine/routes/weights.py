"""Weight updates (from disk, from tensors, by broadcast) and weight version and reads.

Replies are SGLang's ``{"success": bool, "message": str}``: a malformed body is a 400 in the
error shape, an update the engine refuses a 400 with ``success: false``. Every update's tensors
are checked finite first (:func:`titan_rl.engine.weights.check_finite`): one holding NaN or inf
is refused naming the parameter, and nothing of it is applied (weights and version unchanged).

With ``--tp-size N`` every update reaches every TP rank as SGLang's do: a tensor update carries
one entry per rank (rank k decodes entry k), every rank reads a disk checkpoint itself, and
every rank joins a weight-update group (as ``rank_offset + k``) and receives its broadcasts.
Each rank keeps its shard of the full HF tensors; ``/get_weights_by_name`` answers the whole one.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import torch
from fastapi import APIRouter, Depends

from titan_rl.engine.core import Engine
from titan_rl.engine.io_struct import (
    DestroyWeightsUpdateGroupReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from titan_rl.engine.routes.common import HTTPError, ORJSONResponse, body, fail, ok
from titan_rl.engine.state import State
from titan_rl.engine.validation import RequestError
from titan_rl.engine.weights import (
    FromDisk,
    FromGroup,
    FromTensor,
    check_finite,
    decode_tensor_payload,
    join_weight_update_group,
    load_safetensors_dir,
    parse_dtype,
    receive_broadcast,
)
from titan_rl.wire.group import destroy_weights_update_group as destroy_group

router = APIRouter()


def _bump(engine: Engine, version: str | int | None) -> None:
    """Take the request's ``weight_version`` (if it gives one) with the weights."""
    if version is not None:
        engine.weight_version = str(version)


def _is_int_list(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    req: Annotated[UpdateWeightFromDiskReqInput, Depends(body(UpdateWeightFromDiskReqInput))],
    state: State,
) -> ORJSONResponse:
    engine, path = state.engine, req.model_path
    if req.load_format not in (None, "auto", "safetensors"):
        return fail(
            f"load_format {req.load_format!r} is not supported; the CPU engine reads safetensors"
        )
    try:
        tensors = await asyncio.to_thread(load_safetensors_dir, path)
    except RequestError as e:
        return fail(str(e))
    missing = engine.runner.missing_params(set(tensors))
    if getattr(engine.config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    if missing:
        return fail(f"{path!r} lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
    named = [(n, t) for n, t in tensors.items() if engine.runner.knows(n)]
    try:
        await asyncio.to_thread(check_finite, named)
    except RequestError as e:
        return fail(f"{path!r}: {e}")

    def apply() -> int:
        n = engine.runner.update(FromDisk(path), lambda: named)
        engine.model_path = path
        _bump(engine, req.weight_version)
        return n

    try:
        if req.abort_all_requests:
            await state.on_engine(
                lambda: engine.abort(None, abort_all=True, message="aborted for a weight update")
            )
        n = await state.update_on_engine(apply)
    except RequestError as e:
        return fail(str(e))
    return ok(f"Succeeded to update model weights ({n} tensors).", num_paused_requests=0)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(
    req: Annotated[UpdateWeightsFromTensorReqInput, Depends(body(UpdateWeightsFromTensorReqInput))],
    state: State,
) -> ORJSONResponse:
    engine, payloads = state.engine, req.serialized_named_tensors
    if req.load_format not in (None, "direct", "flattened_bucket"):
        return fail(
            f"load_format {req.load_format!r} is not supported; "
            "use null, 'direct' or 'flattened_bucket'"
        )
    if len(payloads) != engine.tp_size:
        return fail(
            f"got {len(payloads)} serialized_named_tensors entries; this engine has tp_size "
            f"{engine.tp_size}: send one entry per TP rank"
        )
    try:
        named = await asyncio.to_thread(decode_tensor_payload, payloads[0], req.load_format)
        await asyncio.to_thread(check_finite, named)
        state.mapped.add(named)
        workers = FromTensor(payloads, req.load_format)
        new_version = req.weight_version is not None

        def apply() -> int:
            n = engine.runner.update(workers, lambda: named, new_version)
            _bump(engine, req.weight_version)
            return n

        n = await state.update_on_engine(apply)
    except RequestError as e:
        return fail(str(e))
    if req.weight_version is not None:
        state.mapped.new_version()
    return ok(f"Succeeded to update {n} tensors.")


@router.post("/init_weights_update_group")
async def init_weights_update_group(
    req: Annotated[InitWeightsUpdateGroupReqInput, Depends(body(InitWeightsUpdateGroupReqInput))],
    state: State,
) -> ORJSONResponse:
    if req.group_name in state.groups:
        return fail(f"weight update group {req.group_name!r} already exists; destroy it first")
    if not 0 < req.master_port < 65536 or req.world_size < 2:
        return fail("master_port must be a TCP port and world_size at least 2 (trainer + engine)")
    args = (
        req.master_address,
        req.master_port,
        req.rank_offset,
        req.world_size,
        req.group_name,
        req.backend,
    )
    try:
        if state.engine.tp_size == 1:
            pg = await asyncio.to_thread(join_weight_update_group, *args)
        else:  # every TP rank joins, in lockstep with the engine's other commands
            pg = await state.on_engine(lambda: state.engine.runner.join_group(*args))
    except RequestError as e:
        return fail(str(e))
    except Exception as e:
        return fail(f"could not join the weight update group: {type(e).__name__}: {e}")
    state.groups[req.group_name] = pg
    return ok("Succeeded to initialize custom process group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    req: Annotated[
        UpdateWeightsFromDistributedReqInput, Depends(body(UpdateWeightsFromDistributedReqInput))
    ],
    state: State,
) -> ORJSONResponse:
    engine, names, dtypes, shapes = state.engine, req.names, req.dtypes, req.shapes
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        return fail("names, dtypes and shapes must be non-empty lists of the same length")
    if not all(isinstance(n, str) for n in names) or not all(_is_int_list(s) for s in shapes):
        return fail("names must be strings and shapes lists of integers")
    if req.load_format not in (None, "flattened_bucket"):
        return fail(
            f"load_format {req.load_format!r} is not supported; use null or 'flattened_bucket'"
        )
    try:  # check before joining the broadcast, which cannot be undone
        for d in dtypes:
            parse_dtype(d)
    except RequestError as e:
        return fail(str(e))
    pg = state.groups.get(req.group_name)
    if pg is None:
        return fail(
            f"no weight update group {req.group_name!r}; call /init_weights_update_group first"
        )
    unknown = [n for n in names if not engine.runner.knows(n)]
    workers = FromGroup(req.group_name, names, dtypes, shapes, req.load_format)

    def receive() -> list[tuple[str, torch.Tensor]]:
        named = receive_broadcast(pg, names, dtypes, shapes, req.load_format)
        if unknown:  # received (so the sender is not stuck) but rejected
            raise RequestError(
                f"unknown parameter {unknown[0]!r}; names must be the HF checkpoint's"
            )
        check_finite(named)  # received whole, so refused whole
        return named

    def apply() -> int:
        n = engine.runner.update(workers, receive)
        _bump(engine, req.weight_version)
        return n

    try:
        n = await state.update_on_engine(apply)
    except RequestError as e:
        return fail(str(e))
    except Exception as e:
        return fail(f"weight broadcast failed: {type(e).__name__}: {e}")
    return ok(f"Succeeded to update {n} tensors online.")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(
    req: Annotated[
        DestroyWeightsUpdateGroupReqInput, Depends(body(DestroyWeightsUpdateGroupReqInput))
    ],
    state: State,
) -> ORJSONResponse:
    pg = state.groups.pop(req.group_name, None)
    if pg is None:
        return fail(f"no weight update group {req.group_name!r}")
    destroy_group(pg)
    if state.engine.tp_size > 1:
        await state.on_engine(lambda: state.engine.runner.destroy_group(req.group_name))
    return ok("Succeeded to destroy custom process group.")


@router.post("/update_weight_version")
async def update_weight_version(
    req: Annotated[UpdateWeightVersionReqInput, Depends(body(UpdateWeightVersionReqInput))],
    state: State,
) -> ORJSONResponse:
    engine = state.engine

    def apply() -> None:
        engine.weight_version = str(req.new_version)

    await state.on_engine(apply)
    state.mapped.new_version()
    return ok(f"Weight version updated to {req.new_version}")


@router.post("/get_weights_by_name")
async def get_weights_by_name(
    req: Annotated[GetWeightsByNameReqInput, Depends(body(GetWeightsByNameReqInput))],
    state: State,
) -> ORJSONResponse:
    engine = state.engine
    if not engine.runner.knows(req.name):
        raise HTTPError(400, f"unknown parameter {req.name!r}")
    if "weights" in engine.memory.released_tags:
        raise HTTPError(400, "the weights are released; resume_memory_occupation first")
    # the whole tensor (put together from the TP ranks' shards), read between steps
    tensor = await state.on_engine(lambda: engine.runner.full_tensor(req.name))
    return ORJSONResponse(tensor.flatten()[: req.truncate_size].float().tolist())
