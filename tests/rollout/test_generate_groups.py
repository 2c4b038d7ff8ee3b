"""``generate_groups`` against a fake SGLang server (httpx MockTransport behind the real
SGLangClient): over-sampling with the dynamic filter, truncation at max_response_len, and
the abort of requests still running once enough groups have passed. One request at a time
(``max_concurrency=1``) makes the completion order the prompt order, so runs are exact."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from titan_rl.config import RolloutConfig
from titan_rl.data import Prompt
from titan_rl.rollout import SGLangClient, SGLangRequestError
from titan_rl.rollout.generate import evaluate, generate_groups, prompt_fingerprint
from titan_rl.rollout.rewarding import RewardCounts
from titan_rl.sample import Sample, Status

STOP = 0


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != STOP)


async def starts_with_one(samples: list[Sample]) -> RewardCounts:
    for s in samples:
        s.reward = 1.0 if s.response.startswith("1") else 0.0
    return RewardCounts()


@dataclass
class FakeSGLang:
    """Answers /generate by the prompt's text: ``same*`` n equal answers "1" (zero reward
    variance), ``mix*`` alternating "1" / "0", ``long*`` runs to max_new_tokens, ``hang*``
    waits until aborted, ``bad*`` is refused (400)."""

    generated: list[str] = field(default_factory=list)
    params: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[dict[str, Any]] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/abort_request":
            self.aborts.append(body)
            self.aborted.set()
            return httpx.Response(200)
        assert request.url.path == "/generate", request.url.path
        return await self.generate(body)

    async def generate(self, body: dict[str, Any]) -> httpx.Response:
        text, sp = decode(body["input_ids"]), body["sampling_params"]
        self.generated.append(text)
        self.params.append(sp)
        n, limit = sp.get("n", 1), sp["max_new_tokens"]
        if text.startswith("bad"):
            return httpx.Response(400, json={"error": {"message": "refused"}})
        if text.startswith("hang"):
            await self.aborted.wait()
            return httpx.Response(200, json=[_out(body, [], "abort")] * n)
        if text.startswith("long"):
            ids = [ord("1")] * limit
            return httpx.Response(200, json=[_out(body, ids, "length")] * n)
        answers = ["1" if text.startswith("same") or i % 2 == 0 else "0" for i in range(n)]
        return httpx.Response(200, json=[_out(body, [ord(a), STOP], "stop") for a in answers])


def _out(
    body: dict[str, Any], ids: list[int], finish: str, version: str = "7", lp: float = -0.5
) -> dict[str, Any]:
    reason = {
        "stop": {"type": "stop", "matched": STOP},
        "length": {"type": "length", "length": len(ids)},
        "abort": {"type": "abort", "message": "aborted"},
    }[finish]
    return {
        "output_ids": ids,
        "meta_info": {
            "id": body["rid"],
            "finish_reason": reason,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for t in ids],
        },
    }


def run(prompts: list[str], want: int, **cfg: Any) -> tuple[Any, FakeSGLang]:
    rollout = RolloutConfig(
        **{"prompts_per_step": want, "n_samples_per_prompt": 4, "max_response_len": 5, **cfg}
    )

    async def main() -> tuple[Any, FakeSGLang]:
        fake = FakeSGLang()
        client = SGLangClient("http://fake", max_concurrency=1, transport=httpx.MockTransport(fake))
        async with client:
            result = await generate_groups(
                client, [Prompt(p, "1", {"src": p}) for p in prompts], encode, decode,
                rollout, [STOP], starts_with_one, want_groups=want, seed=3,
            )  # fmt: skip
        return result, fake

    return asyncio.run(main())


def test_dynamic_filter_drops_zero_variance_groups_and_aborts_the_rest():
    prompts = ["mix1", "same1", "mix2", "hang3", "mix4"]
    result, fake = run(prompts, want=2, dynamic_filter=True, over_sample_factor=2.5)
    # the first two groups that pass, in order; the equal-reward group is dropped
    kept = [s.prompt for s in result.samples]
    assert kept == ["mix1"] * 4 + ["mix2"] * 4
    assert result.groups_generated == 3 and result.groups_filtered == 1
    assert [s.index for s in result.samples[:4]] == [0, 1, 2, 3]
    assert [s.reward for s in result.samples[:4]] == [1.0, 0.0, 1.0, 0.0]
    assert all(s.metadata == {"src": s.prompt} and s.label == "1" for s in result.samples)
    assert all(s.status == Status.COMPLETED and s.weight_version == "7" for s in result.samples)
    assert result.samples[0].rollout_log_probs == [-0.5, -0.5]
    # what was still running is aborted; nothing after it is sent
    assert fake.aborts == [{"rid": "", "abort_all": True}]
    assert fake.generated == ["mix1", "same1", "mix2", "hang3"]
    # per group: n samples of max_response_len tokens at most, a seed of its own
    assert {p["n"] for p in fake.params} == {4} and {p["max_new_tokens"] for p in fake.params} == {
        5
    }
    assert len({p["sampling_seed"] for p in fake.params}) == 4
    assert result.prompt_hash == prompt_fingerprint([Prompt(p, "1", {}) for p in prompts])


def test_without_the_filter_equal_rewards_are_kept():
    result, fake = run(["same1", "mix2", "same3"], want=2)
    assert [s.prompt for s in result.samples][::4] == ["same1", "mix2"]
    assert result.groups_filtered == 0 and [s.reward for s in result.samples[:4]] == [1.0] * 4


def test_truncation_at_max_response_len_is_recorded():
    result, _ = run(["long1", "mix2"], want=2, max_response_len=3)
    long = [s for s in result.samples if s.prompt == "long1"]
    assert all(s.status == Status.TRUNCATED and s.response_length == 3 for s in long)
    assert result.truncated == 4
    assert all(s.status == Status.COMPLETED for s in result.samples if s.prompt == "mix2")


def test_a_refused_request_fails_the_rollout_unless_enough_groups_passed():
    with pytest.raises(SGLangRequestError, match="refused"):
        run(["mix1", "bad2"], want=2)
    result, _ = run(["mix1", "mix2", "bad3"], want=2, over_sample_factor=1.5)
    assert [s.prompt for s in result.samples][::4] == ["mix1", "mix2"]


def test_eval_accuracy_counts_the_answers_the_reward_marks_correct():
    """Accuracy is the share of greedy answers the reward marks ``correct``, whatever their
    scores (a format bonus can lift a wrong answer past 1); unmarked ones count at >= 1."""

    async def bonus(samples: list[Sample]) -> RewardCounts:  # right: 1 + 0.5, wrong: 0 + 1.2
        for s in samples:
            s.correct = s.prompt.startswith("same")
            s.reward = 1.5 if s.correct else 1.2
        return RewardCounts()

    async def unmarked(samples: list[Sample]) -> RewardCounts:
        for s in samples:
            s.reward = 1.0 if s.prompt.startswith("same") else 0.9
        return RewardCounts()

    async def main(reward: Any) -> float:
        fake = FakeSGLang()
        client = SGLangClient("http://fake", max_concurrency=1, transport=httpx.MockTransport(fake))
        prompts = [Prompt(p, "1", {}) for p in ["same1", "long2", "same3", "long4", "long5"]]
        async with client:
            acc = await evaluate(client, prompts, encode, decode, 3, [STOP], reward)
        assert {p.get("temperature") for p in fake.params} == {0.0}
        return acc

    assert asyncio.run(main(bonus)) == 0.4
    assert asyncio.run(main(unmarked)) == 0.4
