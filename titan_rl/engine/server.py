"""The FastAPI app serving SGLang's native HTTP API (the subset an RL trainer uses) on the Engine.

Routes live in :mod:`titan_rl.engine.routes` (one router per concern), request bodies in
:mod:`titan_rl.engine.io_struct`, what the routes share in :class:`ServerState`. Every user
error is a 4xx with ``{"error": {"message": ...}}``; the server keeps serving.
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from titan_rl.engine.core import Engine, QueueFullError
from titan_rl.engine.mapped import MappedStorages
from titan_rl.engine.routes import ROUTERS
from titan_rl.engine.routes.common import HTTPError, error_response
from titan_rl.engine.state import ServerState
from titan_rl.engine.validation import RequestError

__all__ = ["MappedStorages", "create_app"]

log = logging.getLogger("titan_rl.engine.server")

#: paths served without the API key (probes)
_OPEN_PATHS = ("/health", "/health_generate", "/metrics")


def create_app(
    engine: Engine,
    api_key: str | None = None,
    max_request_bytes: int = 64 << 20,
    served_model_name: str | None = None,
) -> FastAPI:
    """Build the HTTP app around an Engine."""
    state = ServerState(engine, max_request_bytes, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Shared-memory segments are unlinked by whichever process drops the last mapping;
        # release ours on a clean stop so /dev/shm does not keep them after both sides exit.
        state.mapped.clear()
        gc.collect()

    app = FastAPI(
        title="titan-rl built-in engine",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.server = state
    if api_key:
        app.middleware("http")(_require_api_key(api_key))
    _add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


def _require_api_key(
    api_key: str,
) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    """SGLang's ``--api-key``: every route but the probes needs ``Authorization: Bearer KEY``."""
    expected = f"Bearer {api_key}".encode()

    async def check(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.method != "OPTIONS" and not request.url.path.startswith(_OPEN_PATHS):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), expected):
                return error_response(
                    401, "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'"
                )
        return await call_next(request)

    return check


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure answered in SGLang's error shape, with a status the caller can act on."""

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
