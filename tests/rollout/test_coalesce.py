"""One batched /generate request for a rollout's group requests (rollout.coalesce): the same
samples as one request per group, against the built-in engine over real HTTP; failures
reach each caller as its own request's would; off where a batch does not fit."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from titan_rl.actors.server import ServerProcess
from titan_rl.config import EnginesConfig, RolloutConfig
from titan_rl.data import Prompt
from titan_rl.rollout import SGLangClient, SGLangRequestError
from titan_rl.rollout.client import SGLangUnavailableError
from titan_rl.rollout.coalesce import CoalescingClient, coalesce_problem, engine_problem
from titan_rl.rollout.engine_api import RetryPolicy
from titan_rl.rollout.generate import evaluate, generate_groups
from titan_rl.rollout.rewarding import RewardCounts
from titan_rl.sample import Sample

EOS = 2  # the tiny model's (conftest)


def encode(text: str) -> list[int]:
    return [3 + ord(c) % 200 for c in text]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


async def no_reward(samples: list[Sample]) -> RewardCounts:
    for s in samples:
        s.reward = float(len(s.response_tokens) % 2)
    return RewardCounts()


class Counting(httpx.AsyncHTTPTransport):
    """A real HTTP transport that counts the /generate requests it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.generate = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            self.generate += 1
        return await super().handle_async_request(request)


def _rollout(url: str, coalesce: bool, prompts: list[str]) -> tuple[list[Sample], int]:
    cfg = RolloutConfig(
        prompts_per_step=len(prompts), n_samples_per_prompt=4, max_response_len=12,
        temperature=1.0,
    )  # fmt: skip

    async def main() -> tuple[list[Sample], int]:
        transport = Counting()
        async with SGLangClient(url, transport=transport) as client:
            result = await generate_groups(
                client, [Prompt(p, "x", {}) for p in prompts], encode, decode, cfg, [EOS],
                no_reward, want_groups=len(prompts), seed=11, coalesce=coalesce,
            )  # fmt: skip
        # kept in the order the groups finished: compared by group and copy
        return sorted(result.samples, key=lambda s: (s.group_index, s.index)), transport.generate

    return asyncio.run(main())


def test_a_coalesced_rollout_samples_what_one_request_per_group_samples(
    engine: ServerProcess,
) -> None:
    prompts = ["1+2=", "7+8=", "a longer prompt, 40+2=", "3+3=", "9+1=", "x"]
    alone, sent_alone = _rollout(engine.url, False, prompts)
    batched, sent_batched = _rollout(engine.url, True, prompts)
    assert sent_alone == len(prompts) and sent_batched == 1
    assert len(alone) == len(batched) == len(prompts) * 4
    for a, b in zip(alone, batched, strict=True):
        assert (a.group_index, a.index, a.prompt) == (b.group_index, b.index, b.prompt)
        assert a.response_tokens == b.response_tokens
        assert a.status == b.status and a.weight_version == b.weight_version
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-4)
    # the samples are not all one: seeds differ by group and copy
    assert len({tuple(s.response_tokens) for s in batched}) > len(prompts)


def test_a_coalesced_evaluation_scores_what_one_request_per_prompt_scores(
    engine: ServerProcess,
) -> None:
    prompts = [Prompt(p, "x", {}) for p in ["1+2=", "7+8=", "a longer one, 40+2=", "3+3=", "x"]]
    scored: dict[bool | str, list[list[int]]] = {}  # by the run: coalesced or not, or waves

    async def reward(samples: list[Sample]) -> RewardCounts:
        scored[coalesce] = [s.response_tokens for s in samples]
        return await no_reward(samples)

    async def main(coalesce: bool, wave: int | None = None) -> tuple[float, int]:
        transport = Counting()
        async with SGLangClient(engine.url, transport=transport) as client:
            acc = await evaluate(
                client, prompts, encode, decode, 12, [EOS], reward, coalesce=coalesce,
                wave=wave,
            )  # fmt: skip
        return acc, transport.generate

    results = {}
    for coalesce in (False, True):
        results[coalesce] = asyncio.run(main(coalesce))
    assert results[False][1] == len(prompts) and results[True][1] == 1
    assert results[False][0] == results[True][0]
    assert scored[False] == scored[True]  # the same greedy answers, prompt by prompt
    # in batches of at most 2 prompts (rollout.max_concurrency): 2, 2, 1
    coalesce = "waves"
    acc, sent = asyncio.run(main(True, wave=2))
    assert sent == 3 and acc == results[False][0] and scored["waves"] == scored[False]


def test_n_1_calls_get_one_output_each_and_abort_all_reaches_a_batch(
    engine: ServerProcess,
) -> None:
    async def main() -> None:
        async with SGLangClient(engine.url) as inner:
            client = CoalescingClient(inner)
            params = {"max_new_tokens": 4, "temperature": 1.0, "n": 1}
            outs = await asyncio.gather(*(
                client.generate(encode(p), {**params, "sampling_seed": i}, return_logprob=True)
                for i, p in enumerate(["1+1=", "2+2=", "3+3="])
            ))  # fmt: skip
            assert client.batches == 1 and client.coalesced_calls == 3
            for i, (p, out) in enumerate(zip(["1+1=", "2+2=", "3+3="], outs, strict=True)):
                alone = await inner.generate(
                    encode(p), {**params, "sampling_seed": i}, return_logprob=True
                )
                assert not isinstance(out, list) and not isinstance(alone, list)
                assert out.output_ids == alone.output_ids

            long = {"max_new_tokens": 200, "temperature": 1.0, "n": 2, "ignore_eos": True}
            calls = [
                asyncio.ensure_future(client.generate(encode(p), long)) for p in ["5+5=", "6+6="]
            ]
            deadline = time.monotonic() + 30
            while True:  # both prompts' copies reached the engine
                info = await inner.get_server_info()
                if info["num_running_reqs"] + info["num_queued_reqs"] >= 4:
                    break
                assert time.monotonic() < deadline, "the batch never reached the engine"
                await asyncio.sleep(0.02)
            await client.abort_request(abort_all=True)
            for outs in await asyncio.gather(*calls):
                assert isinstance(outs, list) and len(outs) == 2
                assert all(o.aborted for o in outs)

    asyncio.run(main())


def _answer(body: dict[str, Any], prompt: list[int], n: int) -> list[dict[str, Any]]:
    return [
        {
            "output_ids": [prompt[0]],
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(prompt),
                "completion_tokens": 1,
                "weight_version": "0",
            },
        }  # fmt: skip
        for _ in range(n)
    ]


def test_a_refused_batch_answers_each_caller_as_its_own_request() -> None:
    bad = encode("bad")
    sent: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body["input_ids"])
        prompts = (
            body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
        )
        if bad in prompts:
            return httpx.Response(400, json={"error": {"message": "bad prompt"}})
        return httpx.Response(200, json=[a for p in prompts for a in _answer(body, p, 2)])

    async def main() -> list[Any]:
        async with SGLangClient("http://e", transport=httpx.MockTransport(handler)) as inner:
            client = CoalescingClient(inner)
            return await asyncio.gather(
                *(client.generate(encode(p), {"n": 2}) for p in ["ok1", "bad", "ok2"]),
                return_exceptions=True,
            )

    ok1, refused, ok2 = asyncio.run(main())
    assert isinstance(refused, SGLangRequestError) and "bad prompt" in refused.message
    assert [o.output_ids for o in ok1] == [[encode("ok1")[0]]] * 2
    assert [o.output_ids for o in ok2] == [[encode("ok2")[0]]] * 2
    assert len(sent[0]) == 3 and len(sent) == 4  # the batch, then each on its own


def test_an_engine_that_fails_a_batch_fails_every_caller() -> None:
    sent: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(503, text="down")

    async def main() -> list[Any]:
        inner = SGLangClient(
            "http://e", retry=RetryPolicy(timeout_s=0), transport=httpx.MockTransport(handler)
        )
        async with inner:
            client = CoalescingClient(inner)
            return await asyncio.gather(
                *(client.generate(encode(p), {"n": 3}) for p in ["a", "b", "c"]),
                return_exceptions=True,
            )

    errors = asyncio.run(main())
    assert all(isinstance(e, SGLangUnavailableError) for e in errors)
    assert len(sent) == 1 and len(sent[0]["input_ids"]) == 3


def test_calls_that_differ_in_n_or_arguments_go_in_separate_requests() -> None:
    sent: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        batch = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batch else [body["input_ids"]]
        sps = body["sampling_params"] if batch else [body["sampling_params"]]
        out = [a for p, sp in zip(prompts, sps, strict=True) for a in _answer(body, p, sp["n"])]
        return httpx.Response(200, json=out if batch or sps[0]["n"] > 1 else out[0])

    async def main() -> None:
        async with SGLangClient("http://e", transport=httpx.MockTransport(handler)) as inner:
            client = CoalescingClient(inner)
            await asyncio.gather(
                client.generate([5], {"n": 2}),
                client.generate([6], {"n": 2}),
                client.generate([7], {"n": 3}),
                client.generate([8], {"n": 2}, return_logprob=True),
            )

    asyncio.run(main())
    shapes = sorted(
        (len(b["input_ids"]) if isinstance(b["input_ids"][0], list) else 0) for b in sent
    )
    assert shapes == [0, 0, 2]  # n=2 pair batched; n=3 and return_logprob alone


def test_off_behind_a_router_several_engines_partial_over_sampling_a_cap_and_sglang() -> None:
    on = RolloutConfig()
    assert coalesce_problem(on, EnginesConfig()) is None
    assert coalesce_problem(on, EnginesConfig(backend="builtin")) is None
    assert "router" in coalesce_problem(on, EnginesConfig(router=True))
    assert "num_engines" in coalesce_problem(on, EnginesConfig(router=True, num_engines=2))
    partial = RolloutConfig(partial=True, over_sample_factor=1.5)
    assert "partial" in coalesce_problem(partial, EnginesConfig())
    assert "over_sample" in coalesce_problem(RolloutConfig(over_sample_factor=1.5), EnginesConfig())
    assert "SGLang" in coalesce_problem(on, EnginesConfig(backend="sglang"))
    capped = RolloutConfig(prompts_per_step=8, max_concurrency=4)
    assert "rollout.max_concurrency=4" in coalesce_problem(capped, EnginesConfig())
    assert (
        coalesce_problem(RolloutConfig(prompts_per_step=8, max_concurrency=8), EnginesConfig())
        is None
    )
    assert "rollout.coalesce=off" in coalesce_problem(
        RolloutConfig(coalesce="off"), EnginesConfig()
    )


def test_only_the_builtin_engine_gets_batches(engine: ServerProcess) -> None:
    def sglang(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"version": "0.5.23"})

    async def main() -> None:
        async with SGLangClient(engine.url) as builtin:
            assert await engine_problem(builtin) is None
        async with SGLangClient("http://e", transport=httpx.MockTransport(sglang)) as real:
            assert "SGLang" in (await engine_problem(real) or "")

    asyncio.run(main())


def test_a_batch_whose_callers_were_all_cancelled_is_cancelled() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("not cancelled")

    async def main() -> None:
        async with SGLangClient("http://e", transport=httpx.MockTransport(handler)) as inner:
            client = CoalescingClient(inner)
            calls = [asyncio.ensure_future(client.generate([t], {"n": 2})) for t in (5, 6)]
            await started.wait()
            calls[0].cancel()
            await asyncio.sleep(0.01)
            assert not cancelled.is_set()  # one caller still waits for it
            calls[1].cancel()
            await asyncio.wait_for(cancelled.wait(), 5)

    asyncio.run(main())
