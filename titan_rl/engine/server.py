"""FastAPI app serving SGLang's native HTTP API (the subset an RL trainer uses) on the Engine.

Every user error is a 4xx with ``{"error": {"message": ...}}``; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from titan_rl.engine.core import MEMORY_TAGS, Engine, QueueFullError, Sequence, sequence_result
from titan_rl.engine.sampling import RequestError, parse_sampling_params
from titan_rl.engine.weights import (
    decode_tensor_payload,
    join_weight_update_group,
    load_safetensors_dir,
    parse_dtype,
    receive_broadcast,
)

log = logging.getLogger("titan_rl.engine.server")

_OPEN_PATHS = ("/health", "/health_generate", "/metrics")


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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _ok(message: str = "Success", **extra: Any) -> ORJSONResponse:
    return ORJSONResponse({"success": True, "message": message, **extra})


def _fail(message: str, status: int = 400) -> ORJSONResponse:
    return ORJSONResponse({"success": False, "message": message}, status_code=status)


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
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


def _field(
    data: dict[str, Any],
    key: str,
    types: type | tuple[type, ...],
    default: Any = None,
    required: bool = False,
) -> Any:
    if key not in data or data[key] is None:
        if required:
            raise HTTPError(400, f"missing required field {key!r}")
        return default
    value = data[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise HTTPError(400, f"field {key!r} has the wrong type (got a boolean)")
    if not isinstance(value, types):
        raise HTTPError(400, f"field {key!r} has the wrong type (got {type(value).__name__})")
    return value


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def create_app(
    engine: Engine,
    api_key: str | None = None,
    max_request_bytes: int = 64 << 20,
    served_model_name: str | None = None,
) -> FastAPI:
    """Build the HTTP app around an Engine."""
    state: dict[str, Any] = {
        "groups": {},
        "started": time.time(),
        "mapped": MappedStorages(_mapped_limit(engine)),
    }

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Shared-memory segments are unlinked by whichever process drops the last mapping;
        # release ours on a clean stop so /dev/shm does not keep them after both sides exit.
        state["mapped"].clear()
        gc.collect()

    app = FastAPI(
        title="titan-rl built-in engine",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if api_key and request.method != "OPTIONS" and not request.url.path.startswith(_OPEN_PATHS):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(
                    401, "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'"
                )
        return await call_next(request)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return _error(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    async def body(request: Request) -> dict[str, Any]:
        return await _read_json(request, max_request_bytes)

    async def on_engine(fn: Any) -> Any:
        return await asyncio.wrap_future(engine.call(fn))

    gate = asyncio.Event()  # closed while a weight update waits or runs
    gate.set()
    update_lock = asyncio.Lock()

    async def update_on_engine(fn: Any) -> Any:
        """Apply a weight update as SGLang's model_update_lock does: unless generation is
        paused, wait for running requests to finish (new ones wait for the update), so no
        response mixes two weight versions."""
        async with update_lock:
            gate.clear()
            try:
                while not engine.paused and engine.num_running() > 0:
                    await asyncio.sleep(0.01)
                return await on_engine(fn)
            finally:
                gate.set()

    # ---- health and info -------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not engine.alive:
            return Response(status_code=503)
        if engine.paused or engine.released:
            return Response(status_code=200)
        try:
            params = parse_sampling_params(
                {"max_new_tokens": 1, "temperature": 0}, engine.vocab_size
            )
            await asyncio.wait_for(_run(engine, [engine.make_sequence([0], params, rid=None)]), 20)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    def model_info() -> dict[str, Any]:
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
            "served_model_name": served_model_name or engine.model_path,
        }

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> ORJSONResponse:
        return ORJSONResponse(model_info())

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> ORJSONResponse:
        return ORJSONResponse(
            {
                **model_info(),
                "engine": "titan_rl.engine",
                "device": "cpu",
                "tp_size": 1,
                "dp_size": 1,
                "context_length": engine.context_length,
                "max_running_requests": engine.max_running,
                "max_queued_requests": engine.max_queued,
                "num_queued_reqs": engine.num_queued(),
                "skip_tokenizer_init": engine.tokenizer is None,
                "num_running_reqs": engine.num_running(),
                "paused": engine.paused,
                "memory_released": engine.released,
                "memory_released_tags": sorted(engine.released_tags),
                "memory_release_count": engine.memory_releases,
                "memory_resume_count": engine.memory_resumes,
                "weight_bytes": engine.weight_bytes(),
                "decode_steps": engine.steps,
                "generated_tokens": engine.generated_tokens,
                "version": "titan-builtin",
            }
        )

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def get_weight_version() -> ORJSONResponse:
        return ORJSONResponse({"weight_version": engine.weight_version})

    # ---- generation --------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        data = await body(request)
        if not engine.alive:
            raise HTTPError(503, "the engine's model thread has stopped; restart the server")
        _check_not_released(engine)
        seqs, single = _build_sequences(engine, data)
        await gate.wait()
        if data.get("stream"):
            return StreamingResponse(_stream(engine, seqs, single), media_type="text/event-stream")
        results = await _run(engine, seqs)
        errors = [s.error for s in results if s.error]
        if errors:
            return _error(500, errors[0])
        out = [sequence_result(s) for s in results]
        return ORJSONResponse(out[0] if single else out)

    # ---- flow control ------------------------------------------------------------------
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if engine.num_running() > 0:
            return PlainTextResponse(
                "Cache not flushed because there are pending requests; retry when idle",
                status_code=400,
            )
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> ORJSONResponse:
        data = await body(request)
        mode = _field(data, "mode", str, "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPError(400, f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}")

        def pause() -> None:
            if mode == "abort":
                engine.abort(None, abort_all=True, message="aborted by pause_generation")
            engine.paused = True

        await on_engine(pause)
        return ORJSONResponse({"success": True, "message": "Generation paused."})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> ORJSONResponse:
        await body(request)

        def resume() -> None:
            engine.paused = False

        await on_engine(resume)
        return ORJSONResponse({"success": True, "message": "Generation continued."})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        data = await body(request)
        rid = _field(data, "rid", str, "")
        abort_all = _field(data, "abort_all", bool, False)
        if not rid and not abort_all:
            raise HTTPError(400, "give 'rid' or set 'abort_all': true")
        await on_engine(lambda: engine.abort(rid or None, abort_all=abort_all))
        return Response(status_code=200)

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request) -> ORJSONResponse:
        data = await body(request)
        tags = _check_tags(data)
        await on_engine(lambda: engine.release_memory(tags))
        return ORJSONResponse(None)

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> ORJSONResponse:
        data = await body(request)
        tags = _check_tags(data)
        await on_engine(lambda: engine.resume_memory(tags))
        return ORJSONResponse(None)

    # ---- weights -------------------------------------------------------------------------
    def _bump(data: dict[str, Any]) -> None:
        version = data.get("weight_version")
        if version is not None:
            engine.weight_version = str(version)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> ORJSONResponse:
        data = await body(request)
        path = _field(data, "model_path", str, required=True)
        load_format = _field(data, "load_format", str, None)
        if load_format not in (None, "auto", "safetensors"):
            return _fail(
                f"load_format {load_format!r} is not supported; the CPU engine reads safetensors"
            )
        abort_all = _field(data, "abort_all_requests", bool, False)
        _field(data, "weight_version", (str, int), None)
        try:
            tensors = await asyncio.to_thread(load_safetensors_dir, path)
        except RequestError as e:
            return _fail(str(e))
        missing = engine.missing_params(set(tensors))
        tied = getattr(engine.config, "tie_word_embeddings", False)
        if tied:
            missing.discard("lm_head.weight")
        if missing:
            return _fail(f"{path!r} lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        named = [(n, t) for n, t in tensors.items() if engine.knows(n)]

        def apply() -> int:
            n = engine.load_named_tensors(named)
            engine.model_path = path
            _bump(data)
            return n

        try:
            if abort_all:
                await on_engine(
                    lambda: engine.abort(
                        None, abort_all=True, message="aborted for a weight update"
                    )
                )
            n = await update_on_engine(apply)
        except RequestError as e:
            return _fail(str(e))
        return _ok(f"Succeeded to update model weights ({n} tensors).", num_paused_requests=0)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> ORJSONResponse:
        data = await body(request)
        payloads = _field(data, "serialized_named_tensors", list, required=True)
        load_format = _field(data, "load_format", str, None)
        if load_format not in (None, "direct", "flattened_bucket"):
            return _fail(
                f"load_format {load_format!r} is not supported; use null, 'direct' or 'flattened_bucket'"
            )
        _field(data, "weight_version", (str, int), None)
        if len(payloads) != 1:
            return _fail(
                f"got {len(payloads)} serialized_named_tensors entries; this engine has tp_size 1"
            )
        try:
            named = await asyncio.to_thread(decode_tensor_payload, payloads[0], load_format)
            state["mapped"].add(named)

            def apply() -> int:
                n = engine.load_named_tensors(named)
                _bump(data)
                return n

            n = await update_on_engine(apply)
        except RequestError as e:
            return _fail(str(e))
        if data.get("weight_version") is not None:
            state["mapped"].new_version()
        return _ok(f"Succeeded to update {n} tensors.")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> ORJSONResponse:
        data = await body(request)
        addr = _field(data, "master_address", str, required=True)
        port = _field(data, "master_port", int, required=True)
        rank_offset = _field(data, "rank_offset", int, required=True)
        world_size = _field(data, "world_size", int, required=True)
        group = _field(data, "group_name", str, "weight_update_group")
        backend = _field(data, "backend", str, "nccl")
        if group in state["groups"]:
            return _fail(f"weight update group {group!r} already exists; destroy it first")
        if not 0 < port < 65536 or world_size < 2:
            return _fail(
                "master_port must be a TCP port and world_size at least 2 (trainer + engine)"
            )
        try:
            pg = await asyncio.to_thread(
                join_weight_update_group, addr, port, rank_offset, world_size, group, backend
            )
        except RequestError as e:
            return _fail(str(e))
        except Exception as e:
            return _fail(f"could not join the weight update group: {type(e).__name__}: {e}")
        state["groups"][group] = pg
        return _ok("Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> ORJSONResponse:
        data = await body(request)
        names = _field(data, "names", list, required=True)
        dtypes = _field(data, "dtypes", list, required=True)
        shapes = _field(data, "shapes", list, required=True)
        group = _field(data, "group_name", str, "weight_update_group")
        load_format = _field(data, "load_format", str, None)
        _field(data, "weight_version", (str, int), None)
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            return _fail("names, dtypes and shapes must be non-empty lists of the same length")
        if not all(isinstance(n, str) for n in names) or not all(_is_int_list(s) for s in shapes):
            return _fail("names must be strings and shapes lists of integers")
        if load_format not in (None, "flattened_bucket"):
            return _fail(
                f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'"
            )
        try:  # check before joining the broadcast, which cannot be undone
            for d in dtypes:
                parse_dtype(d)
        except RequestError as e:
            return _fail(str(e))
        pg = state["groups"].get(group)
        if pg is None:
            return _fail(f"no weight update group {group!r}; call /init_weights_update_group first")
        unknown = [n for n in names if not engine.knows(n)]

        def apply() -> int:
            named = receive_broadcast(pg, names, dtypes, shapes, load_format)
            if unknown:  # received (so the sender is not stuck) but rejected
                raise RequestError(
                    f"unknown parameter {unknown[0]!r}; names must be the HF checkpoint's"
                )
            n = engine.load_named_tensors(named)
            _bump(data)
            return n

        try:
            n = await update_on_engine(apply)
        except RequestError as e:
            return _fail(str(e))
        except Exception as e:
            return _fail(f"weight broadcast failed: {type(e).__name__}: {e}")
        return _ok(f"Succeeded to update {n} tensors online.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> ORJSONResponse:
        data = await body(request)
        group = _field(data, "group_name", str, "weight_update_group")
        pg = state["groups"].pop(group, None)
        if pg is None:
            return _fail(f"no weight update group {group!r}")
        from titan_rl.sync.process_group import destroy_weights_update_group

        destroy_weights_update_group(pg)
        return _ok("Succeeded to destroy custom process group.")

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> ORJSONResponse:
        data = await body(request)
        version = _field(data, "new_version", (str, int), required=True)

        def apply() -> None:
            engine.weight_version = str(version)

        await on_engine(apply)
        state["mapped"].new_version()
        return _ok(f"Weight version updated to {version}")

    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request) -> ORJSONResponse:
        data = await body(request)
        name = _field(data, "name", str, required=True)
        truncate = _field(data, "truncate_size", int, 100)
        tensor = engine.tensor(name)
        if tensor is None:
            raise HTTPError(400, f"unknown parameter {name!r}")
        if "weights" in engine.released_tags:
            raise HTTPError(400, "the weights are released; resume_memory_occupation first")
        return ORJSONResponse(tensor.flatten()[:truncate].float().tolist())

    return app


class MappedStorages:
    """The storages of recent ``/update_weights_from_tensor`` payloads, kept referenced.

    A sender that reuses its shared memory (titan_rl.sync's staging buffers, or with
    ``tensor_format=direct`` its parameters themselves) is then mapped once, not on every
    update: torch's ``rebuild_storage_filename`` finds the live storage in its cache, where
    mapping a segment anew costs page faults (~3 ms per MiB under a sandboxed kernel). A direct
    sync spans one storage per parameter and several requests, so the storages of the current
    weight version's updates and of the previous version's are kept: the next sync finds all
    it sends. Bounded: a version holds each storage once, and once its storages exceed
    ``max_bytes`` (a sender that never bumps the version) it counts as a new version.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.current: dict[int, torch.UntypedStorage] = {}
        self.previous: dict[int, torch.UntypedStorage] = {}
        self.current_bytes = 0

    def add(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for _, t in named:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.current:
                continue
            if self.current_bytes + storage.nbytes() > self.max_bytes:
                self.new_version()
            self.current[key] = storage
            self.current_bytes += storage.nbytes()

    def new_version(self) -> None:
        """The updates so far make a version: keep them (as the previous one) until the next."""
        if self.current:
            self.previous, self.current, self.current_bytes = self.current, {}, 0

    def clear(self) -> None:
        self.current, self.previous, self.current_bytes = {}, {}, 0

    def __len__(self) -> int:
        return len(self.current.keys() | self.previous.keys())


def _mapped_limit(engine: Engine) -> int:
    """The bound of :class:`MappedStorages` per version: a sync's storages are the weights
    (sent by reference, with some staging) or a sender's staging buffers (two buckets)."""
    model = getattr(engine, "model", None)
    n = sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0
    return n + n // 2 + (1 << 30)


def _check_tags(data: dict[str, Any]) -> list[str] | None:
    """The request's memory ``tags`` (None: all of them)."""
    tags = data.get("tags")
    if tags is None:
        return None
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
        raise HTTPError(400, "tags must be null or a list of 'weights', 'kv_cache', 'cuda_graph'")
    return tags


def _check_not_released(engine: Engine) -> None:
    """Generation needs the weights and the KV cache: 503 (retry later) while released."""
    if engine.released:
        held = ", ".join(sorted(engine.released_tags))
        raise HTTPError(
            503,
            f"the engine's memory is released ({held}); call /resume_memory_occupation "
            "(and load weights) before generating",
        )


def _build_sequences(engine: Engine, data: dict[str, Any]) -> tuple[list[Sequence], bool]:
    """Turn a GenerateReqInput into Sequences (prompt-major, n copies each)."""
    if not isinstance(data.get("stream", False), bool):
        raise HTTPError(400, "stream must be true or false")
    if data.get("input_embeds") is not None:
        raise HTTPError(
            400, "input_embeds is not supported by the built-in CPU engine; send input_ids"
        )
    for key in ("image_data", "audio_data", "video_data", "lora_path"):
        if data.get(key):
            raise HTTPError(400, f"{key} is not supported by the built-in CPU engine")
    if data.get("token_ids_logprob") is not None:
        raise HTTPError(400, "token_ids_logprob is not supported by the built-in CPU engine")
    text, input_ids = data.get("text"), data.get("input_ids")
    if (text is None) == (input_ids is None):
        raise HTTPError(400, "give exactly one of 'text' or 'input_ids'")
    if text is not None:
        if engine.tokenizer is None:
            raise HTTPError(
                400, "this server has no tokenizer (skip_tokenizer_init); send input_ids"
            )
        if isinstance(text, str):
            prompts, single = [engine.tokenizer.encode(text)], True
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, single = [engine.tokenizer.encode(t) for t in text], False
        else:
            raise HTTPError(400, "text must be a string or a non-empty list of strings")
    elif _is_int_list(input_ids):
        prompts, single = [input_ids], True
    elif isinstance(input_ids, list) and input_ids and all(_is_int_list(p) for p in input_ids):
        prompts, single = input_ids, False
    else:
        raise HTTPError(
            400, "input_ids must be a list of token ids or a non-empty list of such lists"
        )
    count = len(prompts)
    raw_params = data.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != count:
            raise HTTPError(
                400, f"sampling_params has {len(raw_params)} entries for {count} prompts"
            )
    else:
        raw_params = [raw_params] * count
    params = [
        parse_sampling_params(
            p, engine.vocab_size, "sampling_params" if count == 1 else f"sampling_params[{i}]"
        )
        for i, p in enumerate(raw_params)
    ]
    return_logprob = _list_or_scalar(
        data.get("return_logprob"), count, "return_logprob", bool, False
    )
    start_len = _list_or_scalar(data.get("logprob_start_len"), count, "logprob_start_len", int, -1)
    top_num = _list_or_scalar(data.get("top_logprobs_num"), count, "top_logprobs_num", int, 0)
    rid = data.get("rid")
    if rid is not None and not (
        isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
    ):
        raise HTTPError(400, "rid must be a string or a list of strings")
    if isinstance(rid, str) and count > 1:
        raise HTTPError(400, "a batch needs one rid per prompt (a list)")
    rids = rid if isinstance(rid, list) else [rid] * count
    if len(rids) != count:
        raise HTTPError(400, f"rid has {len(rids)} entries for {count} prompts")
    any_n = any(p.n > 1 for p in params)
    if single and any_n:
        single = False
    seqs: list[Sequence] = []
    for i, prompt in enumerate(prompts):
        for j in range(params[i].n):
            base = rids[i]
            this_rid = (f"{base}_{j}" if params[i].n > 1 else base) if base else None
            if start_len[i] >= len(prompt):
                raise HTTPError(
                    400,
                    f"logprob_start_len {start_len[i]} is past the prompt ({len(prompt)} tokens)",
                )
            if top_num[i] < 0:
                raise HTTPError(400, "top_logprobs_num must be >= 0")
            seqs.append(
                engine.make_sequence(
                    prompt,
                    params[i],
                    rid=this_rid,
                    seed_offset=j,
                    return_logprob=return_logprob[i],
                    logprob_start_len=start_len[i],
                    top_logprobs_num=top_num[i],
                )
            )
    if len(seqs) > 4096:
        raise HTTPError(400, f"a request may hold at most 4096 sequences, got {len(seqs)}")
    return seqs, single


def _list_or_scalar(value: Any, count: int, key: str, typ: type, default: Any) -> list[Any]:
    if value is None:
        return [default] * count
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count:
        raise HTTPError(400, f"{key} has {len(values)} entries for {count} prompts")
    for v in values:
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise HTTPError(400, f"{key} must be {typ.__name__} (got {v!r})")
    return values


async def _run(engine: Engine, seqs: list[Sequence]) -> list[Sequence]:
    """Submit sequences and wait for all of them; abort them if the caller goes away."""
    loop = asyncio.get_running_loop()
    futures = []
    for s in seqs:
        fut = loop.create_future()

        def done(seq: Sequence, fut: asyncio.Future = fut) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(seq))

        s.on_done = done
        futures.append(fut)
    engine.submit(seqs)
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:
        for s in seqs:
            engine.call(lambda s=s: engine.abort(s.rid))
        raise


def _stream(engine: Engine, seqs: list[Sequence], single: bool) -> AsyncIterator[bytes]:
    """Submit now (so a bad rid is a 400, not a broken stream) and return the SSE chunks:
    ``data: {cumulative response}`` per token, the final response, then ``data: [DONE]``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, dict[str, Any], bool]] = asyncio.Queue()
    for i, s in enumerate(seqs):

        def on_token(seq: Sequence, i: int = i) -> None:
            chunk = engine.snapshot(seq)
            loop.call_soon_threadsafe(queue.put_nowait, (i, chunk, False))

        def on_done(seq: Sequence, i: int = i) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (i, sequence_result(seq), True))

        s.on_token, s.on_done = on_token, on_done
    engine.submit(seqs)

    async def chunks() -> AsyncIterator[bytes]:
        remaining = len(seqs)
        try:
            while remaining:
                i, chunk, final = await queue.get()
                if not single:
                    chunk["index"] = i
                if final:
                    remaining -= 1
                    if seqs[i].error:
                        chunk = {"error": {"message": seqs[i].error, "code": 500}}
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if remaining:  # the caller went away: stop generating for it
                for s in seqs:
                    engine.call(lambda s=s: engine.abort(s.rid))

    return chunks()
