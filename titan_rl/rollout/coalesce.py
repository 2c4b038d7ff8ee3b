"""One batched ``/generate`` request for the group requests a rollout sends at once.

The built-in rollout sends one request per group (n completions of one prompt), all in the
same event-loop turn. :class:`CoalescingClient` wraps the engine's client and sends the
``generate`` calls issued in one turn with the same keyword arguments and the same ``n`` as
one batched request (lists of ``input_ids``, ``sampling_params`` and ``rid``, one per
caller; SGLang's ``GenerateReqInput`` requires one ``n`` across a batch); each caller gets
its own slice of the prompt-major answer, as its own request would have returned it (the
built-in engine samples copy ``j`` of a prompt with that prompt's ``sampling_seed + j``,
batched or not). The engine then serves one HTTP request instead of one per group: ~14%
less rollout time at 8 groups x 8 samples on the built-in engine with one thread.

It is off (:func:`coalesce_problem` says why) where a batch would cost more than it saves:
behind a router or with several engines (one engine would get the whole batch), with
over-sampling or partial rollouts (a group that finished early would wait for the batch's
slowest), with another client than ``sglang``, and on SGLang servers, which prefill a batch
with ``n > 1`` prompt by prompt before sampling (``tokenizer_manager._handle_batch_request``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_rl.rollout.client import SGLangClient, SGLangRequestError
from titan_rl.rollout.engine_api import EngineClient, GenerateOutput

if TYPE_CHECKING:
    from titan_rl.config import EnginesConfig, RolloutConfig

#: the config key
KEY = "rollout.coalesce"
#: sequences (prompts x n) one batched request holds at most (the built-in engine's limit)
MAX_BATCH_SEQUENCES = 4096
#: what the built-in engine answers as ``version`` in ``/get_server_info``
BUILTIN_VERSION = "titan-builtin"


def coalesce_problem(rollout: RolloutConfig, engines: EnginesConfig) -> str | None:
    """Why the rollout sends one request per group (None: it coalesces them, as far as the
    config tells; :func:`engine_problem` asks the engine the rest)."""
    if rollout.coalesce == "off":
        return f"{KEY}=off"
    if engines.router or engines.num_engines > 1:
        return (
            "engines.router / engines.num_engines > 1: a batch would go to one engine, "
            "where the router spreads the groups"
        )
    if rollout.partial:
        return "rollout.partial=true: a group that finished early would wait for the batch"
    if rollout.over_sample_factor > 1:
        return (
            "rollout.over_sample_factor > 1: the groups that finish first are kept, and a "
            "batch would make them wait for the slowest"
        )
    if rollout.max_concurrency < rollout.prompts_per_step:
        return (
            f"rollout.max_concurrency={rollout.max_concurrency} is below "
            f"rollout.prompts_per_step={rollout.prompts_per_step}: a batch of every group "
            "would exceed the limit on requests in flight"
        )
    if engines.client != "sglang":
        return f"engines.client={engines.client!r}: only the sglang client sends batches"
    if engines.backend == "sglang":
        return _SGLANG
    return None


_SGLANG = (
    "SGLang prefills a batch with n > 1 prompt by prompt before it samples "
    "(tokenizer_manager._handle_batch_request): one request per group is faster there"
)
#: the engines' answer, per client (asked once)
_ENGINE_KIND: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


async def engine_problem(client: EngineClient) -> str | None:
    """Why the engine behind ``client`` should not get batches (None: it is the built-in
    engine, which serves a batch as the separate requests); asked once per client."""
    if client not in _ENGINE_KIND:
        if not isinstance(client, SGLangClient):
            problem: str | None = "the engine client is not the sglang client"
        else:
            try:  # one attempt: an engine that does not answer now is asked next time
                resp = await client.request("GET", "/get_server_info", retries=0)
                version = resp.json().get("version")
            except Exception as e:  # noqa: BLE001 - an engine that cannot say is not batched
                return f"the engine did not answer /get_server_info ({e})"
            problem = None if version == BUILTIN_VERSION else _SGLANG
        _ENGINE_KIND[client] = problem
    return _ENGINE_KIND[client]


class _Unbatchable(Exception):
    """The engine answered a batch with another number of outputs than it holds."""


@dataclass
class _Call:
    tokens: list[int]
    params: dict[str, Any]
    rid: str
    future: asyncio.Future[GenerateOutput | list[GenerateOutput]]


@dataclass
class _Pending:
    n: int
    return_logprob: bool
    extra: dict[str, Any]
    calls: list[_Call] = field(default_factory=list)


class CoalescingClient:
    """``client`` (an :class:`SGLangClient`), with the ``generate`` calls of one event-loop
    turn that share their keyword arguments and ``n`` sent as one batched request; every
    other call goes to ``client`` as it is (streaming, batches, aborts, weights)."""

    def __init__(self, client: SGLangClient) -> None:
        self.inner = client
        self.base_url = client.base_url
        self._pending: dict[str, _Pending] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: batched requests sent, and the generate calls they answered (a measure of use)
        self.batches = 0
        self.coalesced_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = False,
        rid: str | None = None,
        **extra: Any,
    ) -> GenerateOutput | list[GenerateOutput]:
        """As :meth:`SGLangClient.generate`; the calls of this event-loop turn that can share
        a request go out together once the turn is over."""
        params = dict(sampling_params or {})
        if extra.get("stream"):
            return await self.inner.generate(
                input_ids, params, return_logprob=return_logprob, rid=rid, **extra
            )
        n = int(params.get("n", 1))
        try:
            key = json.dumps([n, return_logprob, extra], sort_keys=True)
        except (TypeError, ValueError):  # an argument JSON cannot hold: sent on its own
            return await self.inner.generate(
                input_ids, params, return_logprob=return_logprob, rid=rid, **extra
            )
        loop = asyncio.get_running_loop()
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(n, return_logprob, dict(extra))
            loop.call_soon(self._flush, key)
        call = _Call(list(input_ids), params, rid or uuid.uuid4().hex, loop.create_future())
        pending.calls.append(call)
        return await call.future

    def _flush(self, key: str) -> None:
        """Send what this turn gathered under ``key``, in batches of at most
        MAX_BATCH_SEQUENCES sequences."""
        pending = self._pending.pop(key)
        calls = [c for c in pending.calls if not c.future.done()]  # cancelled callers
        per_batch = max(1, MAX_BATCH_SEQUENCES // max(1, pending.n))
        for i in range(0, len(calls), per_batch):
            batch = calls[i : i + per_batch]
            task = asyncio.ensure_future(self._send(pending, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            for c in batch:
                c.future.add_done_callback(lambda _, b=batch, t=task: _cancel_if_unwanted(b, t))

    async def _send(self, pending: _Pending, calls: list[_Call]) -> None:
        try:
            if len(calls) == 1:
                await self._send_alone(pending, calls[0])
                return
            try:
                outs = await self._send_batch(pending, calls)
            except (SGLangRequestError, _Unbatchable):
                # refused (4xx): maybe for one caller's arguments; each is sent on its own,
                # to get the answer its own request gets
                await asyncio.gather(*(self._send_alone(pending, c) for c in calls))
                return
            except Exception as e:  # the engine is down, or answered what cannot be read
                for c in calls:
                    _settle(c, exception=e)
                return
            for c, out in zip(calls, outs, strict=True):
                _settle(c, result=out)
        finally:
            for c in calls:  # cancelled with nobody waiting: nothing to answer
                if not c.future.done():
                    c.future.cancel()

    async def _send_alone(self, pending: _Pending, call: _Call) -> None:
        try:
            out = await self.inner.generate(
                call.tokens, call.params, return_logprob=pending.return_logprob,
                rid=call.rid, **pending.extra,
            )  # fmt: skip
        except Exception as e:
            _settle(call, exception=e)
        else:
            _settle(call, result=out)

    async def _send_batch(
        self, pending: _Pending, calls: list[_Call]
    ) -> list[GenerateOutput | list[GenerateOutput]]:
        """One request for ``calls``; each call's outputs, as its own request answers them."""
        outs = await self.inner.generate_batch(
            [c.tokens for c in calls], [c.params for c in calls],
            return_logprob=pending.return_logprob, rids=[c.rid for c in calls], **pending.extra,
        )  # fmt: skip
        n = pending.n
        if len(outs) != n * len(calls):
            raise _Unbatchable(f"a batch of {len(calls)} prompts x n={n} answered {len(outs)}")
        self.batches += 1
        self.coalesced_calls += len(calls)
        sliced = [outs[i * n : (i + 1) * n] for i in range(len(calls))]  # prompt-major
        return [s if n > 1 else s[0] for s in sliced]


def coalescing(client: EngineClient, on: bool) -> EngineClient:
    """``client``, or a :class:`CoalescingClient` over it where ``on`` and it is the sglang
    client (the one that sends batches)."""
    if on and isinstance(client, SGLangClient):
        return CoalescingClient(client)  # type: ignore[return-value]
    return client


def _settle(call: _Call, *, result: Any = None, exception: BaseException | None = None) -> None:
    if call.future.done():  # its caller was cancelled
        return
    if exception is not None:
        call.future.set_exception(exception)
    else:
        call.future.set_result(result)


def _cancel_if_unwanted(calls: list[_Call], task: asyncio.Task[None]) -> None:
    """Cancel a batch's request once every caller waiting for it was cancelled."""
    if all(c.future.cancelled() for c in calls) and not task.done():
        task.cancel()
