"""Colocated engines' memory over HTTP: /release_memory_occupation frees the weights and the
KV cache, generation is refused while released, and after /resume_memory_occupation plus a
weight update the engine serves exactly what it served before (slime's order: resume the
weights, load them, then resume the KV cache)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from titan_rl.actors.server import ServerProcess
from titan_rl.rollout import (
    RetryPolicy,
    SGLangClient,
    SGLangRequestError,
    SGLangUnavailableError,
    WeightUpdateError,
)

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def server(engine_factory, tiny_model: Path) -> ServerProcess:
    return engine_factory(tiny_model, "memory-engine")


def test_release_resume_then_update_serves_the_same_outputs(
    server: ServerProcess, tiny_model: Path
) -> None:
    async def main() -> None:
        # no retries: a 503 while released comes back at once
        async with SGLangClient(server.url, retry=RetryPolicy(max_retries=0)) as c:
            before = await c.generate_batch(PROMPTS, GREEDY, return_logprob=True)
            full = (await c.get_server_info())["weight_bytes"]
            assert full > 0

            await c.release_memory_occupation()  # tags null: all
            info = await c.get_server_info()
            assert info["memory_released_tags"] == ["cuda_graph", "kv_cache", "weights"]
            assert info["weight_bytes"] == 0 and info["memory_release_count"] == 1
            with pytest.raises(SGLangUnavailableError, match="memory is released"):
                await c.generate(PROMPTS[0], GREEDY)
            with pytest.raises(WeightUpdateError, match="weights are released"):
                await c.update_weights_from_disk(str(tiny_model))
            with pytest.raises(SGLangRequestError, match="weights are released"):
                await c.request("POST", "/get_weights_by_name", {"name": "lm_head.weight"})

            await c.resume_memory_occupation(["weights"])
            assert (await c.get_server_info())["weight_bytes"] == full
            with pytest.raises(SGLangUnavailableError, match="kv_cache"):
                await c.generate(PROMPTS[0], GREEDY)  # the KV cache is still released
            await c.update_weights_from_disk(str(tiny_model))
            await c.resume_memory_occupation(["kv_cache", "cuda_graph"])

            info = await c.get_server_info()
            assert info["memory_released"] is False and info["memory_released_tags"] == []
            assert info["memory_resume_count"] == 2
            after = await c.generate_batch(PROMPTS, GREEDY, return_logprob=True)
            assert [o.output_ids for o in after] == [o.output_ids for o in before]
            for a, b in zip(after, before, strict=True):
                assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)

    asyncio.run(main())


def test_release_needs_an_idle_engine(server: ServerProcess) -> None:
    async def main() -> None:
        async with SGLangClient(server.url) as c:
            long = asyncio.create_task(
                c.generate([3, 4], {"max_new_tokens": 200, "ignore_eos": True})
            )
            while (await c.get_server_info())["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(SGLangRequestError, match="idle engine"):
                await c.release_memory_occupation()
            await c.abort_request(abort_all=True)
            assert (await asyncio.wait_for(long, 30)).aborted
            assert (await c.get_server_info())["memory_released"] is False

    asyncio.run(main())
