"""What every route uses: the response shapes, the size-limited body reader and the
dependency that validates a body into its :mod:`titan_rl.engine.io_struct` model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from titan_rl.engine.io_struct import parse_request
from titan_rl.engine.state import ServerState, server_state
from titan_rl.engine.validation import RequestModel

M = TypeVar("M", bound=RequestModel)


class ORJSONResponse(JSONResponse):
    """JSON via orjson (floats and large lists of logprobs serialise fast)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class HTTPError(Exception):
    """An error answered with ``status`` and a message (never a 500)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    """SGLang's error shape: ``{"error": {"message": ..., "code": status}}``."""
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def ok(message: str = "Success", **extra: Any) -> ORJSONResponse:
    """A weight route's success: ``{"success": true, "message": ...}``."""
    return ORJSONResponse({"success": True, "message": message, **extra})


def fail(message: str, status: int = 400) -> ORJSONResponse:
    """A weight route's refusal: ``{"success": false, "message": ...}``."""
    return ORJSONResponse({"success": False, "message": message}, status_code=status)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """Read and parse the body with a size limit; a JSON object or an empty body."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise HTTPError(
                    413, f"request body of {declared} bytes exceeds the limit of {limit} bytes"
                )
        except ValueError:
            raise HTTPError(400, "invalid Content-Length header") from None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or closed by the read timeout (titan_rl.engine.connections)
        raise HTTPError(408, "the connection closed before the request body arrived") from None
    body = b"".join(chunks)
    if not body.strip():
        return {}
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def body(
    model: type[M], check: Callable[[ServerState], None] | None = None
) -> Callable[[Request], Awaitable[M]]:
    """A dependency: the request's body validated as ``model`` (a 400 naming each bad field).
    ``check`` runs once the body has arrived, before it is validated (e.g. a 503 while the
    engine cannot serve: the caller retries the same body later)."""

    async def parse(request: Request) -> M:
        state = server_state(request)
        data = await read_json(request, state.max_request_bytes)
        if check is not None:
            check(state)
        return parse_request(model, data, state.engine.vocab_size)

    return parse
