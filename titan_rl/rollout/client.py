"""One async HTTP client for SGLang's native API (real SGLang, the router, or the CPU engine).

One connection pool, a concurrency limit on generation, timeouts, and retries with
exponential backoff and jitter on connection errors and 5xx answers, never on 4xx (those are
the caller's mistake and come back as :class:`SGLangRequestError` with the server's message).
Retries last a time window (:class:`RetryPolicy`), not a number of attempts: a request that
was in flight when its server died is sent again, whole and with its rid, to the server its
supervisor restarts, or by a router to another engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import orjson

from titan_core.net import client_tls
from titan_rl.rollout.engine_api import (
    ClientOptions,
    EngineError,
    EngineUnavailableError,
    GenerateOutput,
    RetryPolicy,
)

RETRY_STATUS = frozenset({500, 502, 503, 504})
#: the options every client's factory takes; their defaults are this client's
_DEFAULTS = ClientOptions()


class SGLangError(EngineError):
    """Base class of the client's errors."""


class SGLangRequestError(SGLangError):
    """The server refused the request (4xx); retrying the same request will not help."""

    def __init__(self, status: int, message: str, path: str) -> None:
        super().__init__(f"{path}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.path = path


class SGLangUnavailableError(SGLangError, EngineUnavailableError):
    """The server could not be reached or kept failing (5xx) after all retries."""


class WeightUpdateError(SGLangError):
    """A weight update answered ``success: false``."""


def _output(obj: Any, routed_experts_start_len: int = 0) -> GenerateOutput:
    """One completion of SGLang's ``/generate`` answer (``routed_experts_start_len``: as
    sent, the first token of ``meta_info["routed_experts"]``)."""
    if not isinstance(obj, dict) or "meta_info" not in obj:
        raise SGLangError(f"unexpected /generate response: {str(obj)[:200]}")
    meta = obj["meta_info"]
    logprobs = meta.get("output_token_logprobs")
    inputs = meta.get("input_token_logprobs")
    ids = obj.get("output_ids")
    if ids is None and logprobs is not None:
        ids = [int(t[1]) for t in logprobs]
    return GenerateOutput(
        output_ids=list(ids or []),
        finish_reason=meta.get("finish_reason") or {},
        weight_version=meta.get("weight_version"),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", 0)),
        rid=meta.get("id"),
        output_logprobs=None if logprobs is None else [float(t[0]) for t in logprobs],
        text=obj.get("text"),
        input_logprobs=None if inputs is None else [t[0] for t in inputs],
        meta_info=meta,
        routed_experts_start_len=routed_experts_start_len,
    )


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text.strip()[:2000] or resp.reason_phrase
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:2000]


class SGLangClient:
    """Async client of one SGLang endpoint (a server or a router): the ``sglang`` client's
    :class:`~titan_rl.rollout.engine_api.EngineClient`."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        max_concurrency: int = _DEFAULTS.max_concurrency,
        connect_timeout_s: float = 10.0,
        request_timeout_s: float | None = 3600.0,
        control_timeout_s: float = _DEFAULTS.control_timeout_s,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {base_url!r} must start with http:// or https://")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._gen_timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self._ctl_timeout = httpx.Timeout(control_timeout_s, connect=connect_timeout_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            limits=httpx.Limits(
                max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency
            ),
            timeout=self._ctl_timeout,
            transport=transport,
            verify=client_tls(),
        )
        self._sem = asyncio.Semaphore(max_concurrency)
        self._begin_end_supported: bool | None = None
        #: attempts sent again after a connection error or a 5xx (a measure of trouble)
        self.retried = 0

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- transport ----------------------------------------------------------------------
    async def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        *,
        timeout: httpx.Timeout | None = None,
        retries: int | None = None,
        allow_404: bool = False,
    ) -> httpx.Response:
        """Send with retries on connection errors and 5xx (within the retry window; at most
        ``retries`` extra attempts when given); raise SGLangRequestError on 4xx."""
        policy = self.retry
        max_retries = policy.max_retries if retries is None else retries
        first_failure: float | None = None  # the window opens here (a long generation is fine)
        last: str = ""
        attempt = 0
        while True:
            try:
                resp = await self._http.request(
                    method, path, json=json, timeout=timeout or self._ctl_timeout
                )
            except (httpx.TransportError, httpx.DecodingError) as e:
                # connect/read/write errors, the server dying mid-response, pool timeouts
                last = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code == 404 and allow_404:
                    return resp
                if resp.status_code not in RETRY_STATUS:
                    raise SGLangRequestError(resp.status_code, _error_message(resp), path)
                last = f"HTTP {resp.status_code}: {_error_message(resp)}"
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            left = first_failure + policy.timeout_s - now
            if (max_retries is not None and attempt >= max_retries) or left <= 0:
                break
            await asyncio.sleep(min(policy.delay(attempt), left))
            attempt += 1
            self.retried += 1
        raise SGLangUnavailableError(
            f"{method} {self.base_url}{path} failed after {attempt + 1} attempts over "
            f"{time.monotonic() - first_failure:.1f}s (retry window {policy.timeout_s:g}s); "
            f"last error: {last}"
        )

    # ---- health ---------------------------------------------------------------------------
    async def _probe(self, path: str, timeout_s: float = 10.0) -> httpx.Response | None:
        """GET ``path`` once; None when the server does not answer. A pooled keep-alive
        connection the server closed just as the request went out (uvicorn drops idle ones
        after 5 s) breaks without an answer from a live server: that one is asked again at
        once on a fresh connection; a refused connection or a timeout is not."""
        for again in (False, True):
            try:
                return await self._http.get(path, timeout=timeout_s)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                if again:
                    return None
            except httpx.HTTPError:
                return None
        return None

    async def health(self, generate: bool = False) -> bool:
        """True if ``/health`` (or ``/health_generate``) answers 200 right now."""
        resp = await self._probe("/health_generate" if generate else "/health")
        return resp is not None and resp.status_code == 200

    async def wait_healthy(
        self, timeout_s: float = 300.0, interval_s: float = 0.5, generate: bool = False
    ) -> None:
        """Poll health until it answers 200; raise TimeoutError naming the URL at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            if await self.health(generate=generate):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.base_url} was not healthy within {timeout_s:.0f}s; check the server's log"
                )
            await asyncio.sleep(interval_s)

    async def get_model_info(self) -> dict[str, Any]:
        return (await self.request("GET", "/get_model_info")).json()

    async def get_server_info(self) -> dict[str, Any]:
        return (await self.request("GET", "/get_server_info")).json()

    async def weight_version(self) -> str | None:
        """The version of the weights the server holds now, in one attempt (see
        :meth:`_probe`); None when it does not answer (dead, restarting) or answers 5xx."""
        resp = await self._probe("/get_model_info")
        if resp is None or resp.status_code != 200:
            return None
        try:
            version = resp.json().get("weight_version")
        except ValueError:
            return None
        return None if version is None else str(version)

    # ---- generation -------------------------------------------------------------------------
    async def generate_raw(self, payload: dict[str, Any]) -> Any:
        """POST /generate with a raw GenerateReqInput; the parsed JSON answer."""
        async with self._sem:
            resp = await self.request("POST", "/generate", payload, timeout=self._gen_timeout)
        return orjson.loads(resp.content)  # a batch's logprobs: ~1/3 of json's time

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = False,
        rid: str | None = None,
        **extra: Any,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Generate for one prompt; a list when ``sampling_params['n'] > 1``.

        A rid is always sent (generated when not given) so a retried request keeps its id.
        """
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "rid": rid or uuid.uuid4().hex,
            **extra,
        }
        data = await self.generate_raw(payload)
        start = int(payload.get("routed_experts_start_len") or 0)
        if isinstance(data, list):
            return [_output(d, start) for d in data]
        return _output(data, start)

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = False,
        rid: str | None = None,
        **extra: Any,
    ) -> AsyncIterator[GenerateOutput]:
        """Stream one prompt's cumulative outputs (SSE). Not retried once the stream has begun,
        since a retry would repeat tokens already delivered."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "rid": rid or uuid.uuid4().hex,
            "stream": True,
            **extra,
        }
        async with (
            self._sem,
            self._http.stream("POST", "/generate", json=payload, timeout=self._gen_timeout) as resp,
        ):
            if resp.status_code >= 400:
                await resp.aread()
                cls = SGLangRequestError if resp.status_code < 500 else SGLangUnavailableError
                if cls is SGLangRequestError:
                    raise SGLangRequestError(resp.status_code, _error_message(resp), "/generate")
                raise SGLangUnavailableError(
                    f"/generate: HTTP {resp.status_code}: {_error_message(resp)}"
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                obj = orjson.loads(data)
                if "error" in obj:
                    raise SGLangError(f"/generate stream: {obj['error']}")
                yield _output(obj, int(payload.get("routed_experts_start_len") or 0))

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        return_logprob: bool = False,
        rids: Sequence[str] | None = None,
        **extra: Any,
    ) -> list[GenerateOutput]:
        """One request holding several prompts; outputs prompt-major (n per prompt).
        ``rids``: one per prompt (generated when not given)."""
        payload: dict[str, Any] = {
            "input_ids": [list(p) for p in prompts],
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
            "rid": list(rids) if rids is not None else [uuid.uuid4().hex for _ in prompts],
            **extra,
        }
        data = await self.generate_raw(payload)
        if not isinstance(data, list):
            data = [data]
        start = int(payload.get("routed_experts_start_len") or 0)
        return [_output(d, start) for d in data]

    # ---- flow control -------------------------------------------------------------------------
    async def flush_cache(self) -> bool:
        """True if flushed; False if the server refused because requests are running."""
        try:
            await self.request("POST", "/flush_cache")
        except SGLangRequestError:
            return False
        return True

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def abort_request(
        self, rid: str = "", abort_all: bool = False, *, retries: int | None = None
    ) -> None:
        if not rid and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        await self.request(
            "POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, retries=retries
        )

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.request("POST", "/resume_memory_occupation", {"tags": tags})

    # ---- weights ---------------------------------------------------------------------------------
    async def _weights_call(
        self, path: str, payload: dict[str, Any], retries: int | None = None
    ) -> dict[str, Any]:
        resp = await self.request("POST", path, payload, retries=retries)
        return self._check_success(resp, path)

    @staticmethod
    def _check_success(resp: httpx.Response, path: str) -> dict[str, Any]:
        data = resp.json()
        if isinstance(data, dict) and data.get("success") is False:
            raise WeightUpdateError(f"{path}: {data.get('message')}")
        return data

    @contextlib.asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[None]:
        """``/begin_weight_update`` ... ``/end_weight_update`` where the server has them (SGLang
        0.5.23); older servers answer 404, which is remembered and skipped."""
        began = False
        if self._begin_end_supported is not False:
            resp = await self.request(
                "POST", "/begin_weight_update", {"selector": "all"}, allow_404=True
            )
            self._begin_end_supported = resp.status_code != 404
            began = self._begin_end_supported
        try:
            yield
        finally:
            if began:
                await self.request("POST", "/end_weight_update", {})

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Make the server load a checkpoint directory on its own host."""
        payload: dict[str, Any] = {
            "model_path": model_path,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        # errors answer 400 with success false: surface the server's message
        try:
            resp = await self.request("POST", "/update_weights_from_disk", payload)
        except SGLangRequestError as e:
            raise WeightUpdateError(f"/update_weights_from_disk: {e.message}") from None
        return self._check_success(resp, "/update_weights_from_disk")

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Send one serialized payload per TP rank (see :func:`serialize_named_tensors`)."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        async with self.weight_update_session():
            try:
                return await self._weights_call("/update_weights_from_tensor", payload)
            except SGLangRequestError as e:
                raise WeightUpdateError(f"/update_weights_from_tensor: {e.message}") from None

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Blocks until the trainer (rank 0) joins the same rendezvous; never retried."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        try:
            return await self._weights_call("/init_weights_update_group", payload, retries=0)
        except SGLangRequestError as e:
            raise WeightUpdateError(f"/init_weights_update_group: {e.message}") from None

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Tell the engine to receive a broadcast; the trainer broadcasts concurrently. Never retried."""
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        async with self.weight_update_session():
            try:
                return await self._weights_call(
                    "/update_weights_from_distributed", payload, retries=0
                )
            except SGLangRequestError as e:
                raise WeightUpdateError(f"/update_weights_from_distributed: {e.message}") from None

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        try:
            return await self._weights_call(
                "/destroy_weights_update_group", {"group_name": group_name}
            )
        except SGLangRequestError as e:
            raise WeightUpdateError(f"/destroy_weights_update_group: {e.message}") from None

    async def update_weight_version(self, new_version: str) -> dict[str, Any]:
        return await self._weights_call("/update_weight_version", {"new_version": new_version})
