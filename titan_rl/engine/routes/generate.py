"""``/generate``: a validated :class:`GenerateReqInput` becomes the engine's sequences."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse

from titan_rl.engine.core import Engine, Sequence, sequence_result
from titan_rl.engine.dispatch import run_sequences, stream_sequences
from titan_rl.engine.io_struct import GenerateReqInput
from titan_rl.engine.routes.common import HTTPError, ORJSONResponse, body, error_response
from titan_rl.engine.state import ServerState, State
from titan_rl.engine.validation import RequestError

router = APIRouter()


def check_serving(state: ServerState) -> None:
    """Generation needs a live model thread, the weights and the KV cache: 503 otherwise."""
    engine = state.engine
    if not engine.alive:
        raise HTTPError(503, "the engine's model thread has stopped; restart the server")
    if engine.memory.released:
        held = ", ".join(sorted(engine.memory.released_tags))
        raise HTTPError(
            503,
            f"the engine's memory is released ({held}); call /resume_memory_occupation "
            "(and load weights) before generating",
        )


def prompt_ids(engine: Engine, req: GenerateReqInput) -> list[list[int]]:
    """The request's prompts as token ids (``text`` needs the server's tokenizer)."""
    if req.text is None:
        return req.prompts
    if engine.tokenizer is None:
        raise RequestError("this server has no tokenizer (skip_tokenizer_init); send input_ids")
    return [engine.tokenizer.encode(t) for t in req.prompts]


def check_stop_strings(engine: Engine, req: GenerateReqInput) -> None:
    """Stop texts are matched on decoded text: without a tokenizer they could never match,
    so the request is refused rather than run past them."""
    if engine.tokenizer is not None:
        return
    for params in req.per_prompt("sampling_params"):
        if params.stop_strings():
            raise RequestError(
                f"sampling_params.stop {params.stop!r}: this server has no tokenizer "
                "(skip_tokenizer_init, or none beside the weights), so stop texts cannot be "
                "matched; send their token ids as stop_token_ids"
            )


def check_routed_experts(engine: Engine, req: GenerateReqInput) -> None:
    """Routed experts exist only where tokens are routed: a dense model is a 400."""
    if req.return_routed_experts and not engine.routing.is_moe:
        raise RequestError(
            f"return_routed_experts: the served model ({engine.config.model_type}) has no MoE "
            "layers, so its tokens are routed to no experts; send return_routed_experts: false "
            "(or serve an MoE model)"
        )


def build_sequences(engine: Engine, req: GenerateReqInput) -> list[Sequence]:
    """One sequence per prompt and copy (``n``), prompt-major; copy ``j`` of rid ``r`` is
    ``r_j`` and samples with ``sampling_seed + j``."""
    seqs: list[Sequence] = []
    per_prompt = zip(
        prompt_ids(engine, req),
        req.per_prompt("sampling_params"),
        req.per_prompt("rid"),
        req.per_prompt("return_logprob"),
        req.per_prompt("logprob_start_len"),
        req.per_prompt("top_logprobs_num"),
        strict=True,
    )
    check_routed_experts(engine, req)
    check_stop_strings(engine, req)
    for prompt, params, rid, return_logprob, start_len, top_num in per_prompt:
        if start_len >= len(prompt):
            raise RequestError(
                f"logprob_start_len {start_len} is past the prompt ({len(prompt)} tokens)"
            )
        routed_start = req.routed_experts_start_len
        if req.return_routed_experts and routed_start > len(prompt):
            raise RequestError(
                f"routed_experts_start_len {routed_start} is higher than the number of input "
                f"tokens ({len(prompt)}); give at most the prompt's length"
            )
        for j in range(params.n):
            seqs.append(
                engine.make_sequence(
                    prompt,
                    params,
                    rid=(f"{rid}_{j}" if params.n > 1 else rid) if rid else None,
                    seed_offset=j,
                    return_logprob=return_logprob,
                    logprob_start_len=start_len,
                    top_logprobs_num=top_num,
                    return_routed_experts=req.return_routed_experts,
                    routed_experts_start_len=req.routed_experts_start_len,
                )
            )
    return seqs


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(
    req: Annotated[GenerateReqInput, Depends(body(GenerateReqInput, check_serving))],
    state: State,
) -> Response:
    engine = state.engine
    seqs = build_sequences(engine, req)
    await state.gate.wait()
    if req.stream:
        return StreamingResponse(
            stream_sequences(engine, seqs, req.single_response), media_type="text/event-stream"
        )
    results = await run_sequences(engine, seqs)
    errors = [s.error for s in results if s.error]
    if errors:
        return error_response(500, errors[0])
    out = [sequence_result(s) for s in results]
    return ORJSONResponse(out[0] if req.single_response else out)
