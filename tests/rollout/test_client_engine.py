"""The SGLang client against the built-in engine over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from titan_core.net import free_port
from titan_rl.actors.server import ServerProcess
from titan_rl.rollout import RetryPolicy, SGLangClient, SGLangRequestError, SGLangUnavailableError

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_generate_fields_and_logprobs(engine: ServerProcess) -> None:
    async def main() -> None:
        async with SGLangClient(engine.url) as client:
            await client.wait_healthy(timeout_s=10)
            out = await client.generate(
                [5, 6, 7], {"max_new_tokens": 9, **GREEDY}, return_logprob=True, rid="abc"
            )
            assert (
                len(out.output_ids) == 9 and out.completion_tokens == 9 and out.prompt_tokens == 3
            )
            assert out.finish_reason == {"type": "length", "length": 9}
            assert out.weight_version == "default" and out.rid == "abc"
            assert out.output_logprobs is not None and len(out.output_logprobs) == 9
            assert all(lp <= 0.0 for lp in out.output_logprobs)
            # no logprobs unless asked
            plain = await client.generate([5, 6, 7], {"max_new_tokens": 9, **GREEDY})
            assert plain.output_ids == out.output_ids and plain.output_logprobs is None
            # n > 1 gives a list; a batch is prompt-major
            many = await client.generate([5], {"max_new_tokens": 4, "n": 3, "ignore_eos": True})
            assert isinstance(many, list) and len(many) == 3
            batch = await client.generate_batch(
                [[5], [6, 7]], {"max_new_tokens": 3, "n": 2, "ignore_eos": True}
            )
            assert [o.prompt_tokens for o in batch] == [1, 1, 2, 2]
            info = await client.get_model_info()
            assert info["weight_version"] == "default" and info["is_generation"] is True

    asyncio.run(main())


def test_streaming_is_cumulative_and_ends_like_non_streaming(engine: ServerProcess) -> None:
    async def main() -> None:
        async with SGLangClient(engine.url) as client:
            params = {"max_new_tokens": 6, **GREEDY}
            full = await client.generate([8, 9, 10], params, return_logprob=True)
            chunks = [
                c async for c in client.generate_stream([8, 9, 10], params, return_logprob=True)
            ]
            assert [len(c.output_ids) for c in chunks] == [1, 2, 3, 4, 5, 6]
            assert all(not c.finish_reason for c in chunks[:-1])
            last = chunks[-1]
            assert last.output_ids == full.output_ids and last.finish_reason == full.finish_reason
            assert last.output_logprobs == pytest.approx(full.output_logprobs, abs=1e-5)
            with pytest.raises(SGLangRequestError, match="temperature"):
                async for _ in client.generate_stream([1], {"temperature": -1}):
                    pass

    asyncio.run(main())


def test_sampling_seed_reproducible_over_http(engine: ServerProcess) -> None:
    async def main() -> None:
        async with SGLangClient(engine.url) as client:
            params = {
                "max_new_tokens": 20,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": 7,
            }
            noise = [
                client.generate([i + 1], {"max_new_tokens": 30, "ignore_eos": True})
                for i in range(4)
            ]
            first, *_ = await asyncio.gather(client.generate([4, 5], params), *noise)
            again = await client.generate([4, 5], params)
            assert first.output_ids == again.output_ids
            other = await client.generate([4, 5], {**params, "sampling_seed": 8})
            assert other.output_ids != first.output_ids
            copies = await client.generate([4, 5], {**params, "n": 2})
            assert copies[0].output_ids == first.output_ids != copies[1].output_ids

    asyncio.run(main())


def test_concurrent_requests_share_decode_steps(engine: ServerProcess) -> None:
    async def main() -> None:
        async with SGLangClient(engine.url, max_concurrency=32) as client:
            before = await client.get_server_info()
            outs = await asyncio.gather(
                *[client.generate([i + 3, 9], {"max_new_tokens": 16, **GREEDY}) for i in range(24)]
            )
            after = await client.get_server_info()
            assert all(len(o.output_ids) == 16 for o in outs)
            steps = after["decode_steps"] - before["decode_steps"]
            assert steps < 24 * 15 / 3, (
                f"{steps} decode steps for 24 concurrent requests: not batched"
            )

    asyncio.run(main())


async def _until_running(client: SGLangClient, n: int = 1, timeout_s: float = 30.0) -> None:
    """Wait until the engine holds at least ``n`` requests, running or waiting (slow CI
    machines; a paused engine queues a new request)."""

    async def held() -> int:
        info = await client.get_server_info()
        return info["num_running_reqs"] + info["num_queued_reqs"]

    deadline = time.monotonic() + timeout_s
    while await held() < n:
        assert time.monotonic() < deadline, "request never reached the engine"
        await asyncio.sleep(0.02)


def test_pause_continue_and_abort(engine: ServerProcess) -> None:
    async def main() -> None:
        async with SGLangClient(engine.url) as client:
            try:
                # in_place pause: a new request waits, then finishes after continue
                await client.pause_generation("in_place")
                task = asyncio.create_task(client.generate([3, 4], {"max_new_tokens": 5, **GREEDY}))
                await _until_running(client)
                await asyncio.sleep(0.3)
                assert not task.done()
                assert (await client.get_server_info())["paused"] is True
                await client.continue_generation()
                out = await asyncio.wait_for(task, 30)
                assert len(out.output_ids) == 5 and out.finish_type == "length"
                # abort by rid: the running request ends with an abort finish reason
                long = asyncio.create_task(
                    client.generate([3, 4], {"max_new_tokens": 250, **GREEDY}, rid="to-abort")
                )
                await _until_running(client)
                await client.abort_request("to-abort")
                res = await asyncio.wait_for(long, 30)
                assert res.aborted and len(res.output_ids) < 250
                # pause(abort) aborts what is running, then continue serves again
                long = asyncio.create_task(
                    client.generate([3, 4], {"max_new_tokens": 250, **GREEDY})
                )
                await _until_running(client)
                await client.pause_generation("abort")
                assert (await asyncio.wait_for(long, 30)).aborted
            finally:
                await client.continue_generation()
            assert (
                len((await client.generate([3], {"max_new_tokens": 2, **GREEDY})).output_ids) == 2
            )
            # flush when idle, KV cache release / resume (weights: test_memory_release.py)
            assert await client.flush_cache() is True
            try:
                await client.release_memory_occupation(["kv_cache"])
                assert (await client.get_server_info())["memory_released"] is True
            finally:
                await client.resume_memory_occupation(["kv_cache"])
            assert (
                len((await client.generate([3], {"max_new_tokens": 2, **GREEDY})).output_ids) == 2
            )

    asyncio.run(main())


def test_wait_healthy_deadline_and_unreachable_server() -> None:
    async def main() -> None:
        url = f"http://127.0.0.1:{free_port()}"
        retry = RetryPolicy(max_retries=2, initial_backoff_s=0.01)
        async with SGLangClient(url, retry=retry) as client:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="not healthy within"):
                await client.wait_healthy(timeout_s=0.5, interval_s=0.1)
            assert time.monotonic() - t0 < 5
            with pytest.raises(SGLangUnavailableError, match="after 3 attempts"):
                await client.generate([1], {"max_new_tokens": 1})

    asyncio.run(main())


def test_retries_5xx_and_connection_errors_never_4xx() -> None:
    calls: dict[str, int] = {"gen": 0, "bad": 0, "flaky": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            calls["gen"] += 1
            if calls["gen"] == 1:
                raise httpx.ConnectError("connection refused", request=request)
            if calls["gen"] == 2:
                return httpx.Response(503, json={"error": {"message": "busy"}})
            return httpx.Response(
                200,
                json={
                    "output_ids": [1],
                    "meta_info": {
                        "id": "x",
                        "finish_reason": {"type": "length", "length": 1},
                        "prompt_tokens": 1,
                        "completion_tokens": 1,
                        "weight_version": "w",
                    },
                },
            )
        if request.url.path == "/flush_cache":
            calls["bad"] += 1
            return httpx.Response(400, json={"error": {"message": "requests are running"}})
        if request.url.path == "/begin_weight_update":
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == "/update_weights_from_tensor":
            calls["flaky"] += 1
            return httpx.Response(200, json={"success": True, "message": "ok"})
        return httpx.Response(404)

    async def main() -> None:
        retry = RetryPolicy(max_retries=3, initial_backoff_s=0.001)
        async with SGLangClient(
            "http://engine", retry=retry, transport=httpx.MockTransport(handler)
        ) as c:
            out = await c.generate([1], {"max_new_tokens": 1})
            assert out.output_ids == [1] and calls["gen"] == 3
            with pytest.raises(SGLangRequestError) as err:
                await c.request("POST", "/flush_cache")
            assert err.value.status == 400 and "requests are running" in err.value.message
            assert calls["bad"] == 1  # a 4xx is never retried
            # old servers answer 404 to /begin_weight_update: probed once, then skipped
            await c.update_weights_from_tensor(["x"])
            await c.update_weights_from_tensor(["x"])
            assert calls["flaky"] == 2 and c._begin_end_supported is False

    asyncio.run(main())
