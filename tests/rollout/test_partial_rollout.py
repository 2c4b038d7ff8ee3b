"""Partial rollouts (rollout.partial): a step's leftovers are aborted with their tokens,
carried, and continued on newer weights by the next rollout; every token keeps the version
that produced it and its logprob.

The bookkeeping runs against a fake SGLang server (exact tokens, seeds, budgets); the
continuation across a real weight update runs on the built-in engine and is checked against
HF transformers' greedy decoding of the new weights."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import ValidationError
from test_generate_groups import STOP, _out, decode, encode, starts_with_one

from titan_rl.config import RolloutConfig
from titan_rl.data import Prompt
from titan_rl.rollout import SGLangClient
from titan_rl.rollout.generate import RolloutResult, generate_groups, sample_from
from titan_rl.rollout.hooks import RolloutContext
from titan_rl.rollout.partial import CarriedGroup, PartialBuffer, continue_sample
from titan_rl.sample import Sample, Status
from titan_rl.step_log import status_line, step_record, version_stats
from titan_rl.trainer.batch import pack_samples

A, B = ord("a"), ord("b")


@dataclass
class FakeSGLang:
    """``fast*`` answers "1" at once (version 7); ``slow*`` writes "aa", waits until aborted
    and answers what it has (version 7); a continuation of a ``slow*`` prompt (its input
    holds the earlier tokens) answers "b" + end of text on version 8."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    aborts: int = 0
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/abort_request":
            self.aborts += 1
            self.aborted.set()
            return httpx.Response(200)
        self.requests.append(body)
        text, sp = decode(body["input_ids"]), body["sampling_params"]
        n = sp.get("n", 1)
        if text.startswith("fast"):
            return httpx.Response(200, json=[_out(body, [ord("1"), STOP], "stop", "7", -0.25)] * n)
        if text.startswith("stuck"):  # an engine that never answers, aborted or not
            await asyncio.Event().wait()
        if text.endswith("aa"):
            return httpx.Response(200, json=[_out(body, [B, STOP], "stop", "8", -0.75)] * n)
        await self.aborted.wait()
        return httpx.Response(200, json=[_out(body, [A, A], "abort", "7", -0.25)] * n)


def _rollout(
    fake: FakeSGLang, prompts: list[str], carried: list[CarriedGroup], want: int
) -> RolloutResult:
    cfg = RolloutConfig(
        prompts_per_step=want, n_samples_per_prompt=2, max_response_len=5,
        over_sample_factor=3.0, partial=True,
    )  # fmt: skip

    async def main() -> RolloutResult:
        client = SGLangClient("http://fake", transport=httpx.MockTransport(fake))
        async with client:
            return await generate_groups(
                client, [Prompt(p, "1", {}) for p in prompts], encode, decode, cfg, [STOP],
                starts_with_one, want_groups=want, seed=3, carried=carried,
            )  # fmt: skip

    return asyncio.run(main())


def test_leftovers_are_carried_and_continued_with_their_tokens_and_versions():
    fake = FakeSGLang()
    first = _rollout(fake, ["fast1", "slow2", "fast3"], [], want=1)
    assert [s.prompt for s in first.samples] in (["fast1"] * 2, ["fast3"] * 2)
    assert fake.aborts >= 1
    carried = {g.prompt.text: g for g in first.carry}
    assert len(carried) == 2 and "slow2" in carried
    extra = carried[({"fast1", "fast3"} - {first.samples[0].prompt}).pop()]
    assert extra.scored and [s.reward for s in extra.samples] == [1.0, 1.0]
    slow = carried["slow2"]
    assert not slow.scored and slow.unfinished == 2
    for s in slow.samples:
        assert s.status == Status.ABORTED and s.response_tokens == [A, A]
        assert s.rollout_log_probs == [-0.25, -0.25] and s.token_versions() == ["7", "7"]

    # the checkpointed form gives the same groups back
    buf = PartialBuffer()
    buf.put(first.carry)
    restored = PartialBuffer()
    restored.restore(json.loads(json.dumps(buf.state())))
    assert restored.groups == buf.groups

    fake.requests.clear()
    second = _rollout(fake, [], restored.take(), want=2)
    assert second.carry == []
    by_prompt = {s.prompt: s for s in second.samples}
    assert set(by_prompt) == {"slow2", extra.prompt.text}
    # each aborted sample is continued alone: its prompt and tokens in, the rest of the budget
    assert len(fake.requests) == 2
    for req in fake.requests:
        assert req["input_ids"] == encode("slow2") + [A, A]
        assert req["sampling_params"]["n"] == 1 and req["sampling_params"]["max_new_tokens"] == 3
    assert len({r["sampling_params"]["sampling_seed"] for r in fake.requests}) == 2
    for s in (x for x in second.samples if x.prompt == "slow2"):
        assert s.response_tokens == [A, A, B, STOP] and s.response == "aab"
        assert s.rollout_log_probs == [-0.25, -0.25, -0.75, -0.75]
        assert s.weight_versions == ["7", "7", "8", "8"] and s.weight_version == "8"
        assert s.status == Status.COMPLETED and s.metadata["continued"] == 1
        assert s.reward == 0.0
    # the trained rows hold each token's own rollout logprob
    batch = pack_samples(second.samples, STOP)
    slow_rows = [i for i, s in enumerate(second.samples) if s.prompt == "slow2"]
    p = len(encode("slow2"))
    for i in slow_rows:
        assert batch.rollout_logprobs[i, p - 1 : p + 3].tolist() == [-0.25, -0.25, -0.75, -0.75]
    # the step's record: half the model's tokens were written by another version than the
    # trained policy's (8 = step 9's policy), one update behind
    rec = step_record(9, second, {"time/step": 1.0, "time/rollout": 0.5, "time/train": 0.4,
                                  "time/sync": 0.1})  # fmt: skip
    slow_tokens, fast_tokens = 2 * 4, 2 * 2
    assert rec["rollout/off_policy_token_share"] == pytest.approx(
        (2 * 2 + fast_tokens) / (slow_tokens + fast_tokens)
    )
    assert rec["rollout/carried_token_share"] == rec["rollout/off_policy_token_share"]
    assert rec["rollout/token_lag_max"] == 1 and rec["rollout/continued_samples"] == 2
    assert "partial: continued 2 / carried 0 groups" in status_line(rec, 10)


def test_a_group_that_never_comes_back_is_dropped_at_the_deadline(monkeypatch):
    monkeypatch.setattr("titan_rl.rollout.generate.ABORT_DEADLINE_S", 1.0)
    fake = FakeSGLang()
    result = _rollout(fake, ["fast1", "stuck2", "slow3"], [], want=1)
    assert [s.prompt for s in result.samples] == ["fast1"] * 2
    assert [g.prompt.text for g in result.carry] == ["slow3"]
    assert fake.aborts >= 2  # aborted again while the stuck one stayed out


def test_version_stats_of_on_policy_and_tool_tokens():
    s = Sample(0, 0, "", [1], "", response_tokens=[5, 6, 7], weight_version="4")
    tool = Sample(0, 1, "", [1], "", response_tokens=[5, 6, 7], weight_versions=["4", "", "3"])
    assert version_stats([s], "4") == {
        "rollout/off_policy_token_share": 0.0,
        "rollout/carried_token_share": 0.0,
        "rollout/token_lag_max": 0,
        "rollout/continued_samples": 0,
    }
    # a tool's reply ("") is nobody's token
    assert version_stats([tool], "4")["rollout/off_policy_token_share"] == 0.5
    assert version_stats([tool], "4")["rollout/token_lag_max"] == 1
    assert version_stats([tool], "4")["rollout/carried_token_share"] == 0.5


def test_partial_needs_spare_prompts_and_the_builtin_rollout():
    with pytest.raises(ValidationError, match="over_sample_factor"):
        RolloutConfig(partial=True)
    with pytest.raises(ValidationError, match="over_sample_factor"):
        RolloutConfig(partial=True, prompts_per_step=4, over_sample_factor=1.2)
    with pytest.raises(ValidationError, match="generate_fn"):
        RolloutConfig(partial=True, over_sample_factor=2, generate_fn="my_pkg.agent:generate")
    assert RolloutConfig(partial=True, prompts_per_step=4, over_sample_factor=1.25).partial


# ---- across a real weight update, on the built-in engine ----------------------------------


def _hf_greedy(model_dir: Path, ids: list[int], new: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids, out, lps = list(ids), [], []
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            t = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            out.append(t)
            ids.append(t)
    return out, lps


def test_an_aborted_sample_continues_on_new_weights(engine_factory, make_model, tmp_path):
    first_model = make_model(tmp_path / "v0", seed=0)
    new_model = make_model(tmp_path / "v1", seed=1)
    engine = engine_factory(first_model, "partial", weight_version="0")
    prompt = [1, 40, 41, 42, 43]
    cfg = RolloutConfig()

    async def main() -> tuple[Sample, Sample]:
        async with SGLangClient(engine.url) as client:
            ctx = RolloutContext(client, encode, decode, cfg, [])
            long = {"max_new_tokens": 240, "temperature": 1.0, "n": 8, "stop_token_ids": []}
            template = Sample(0, 0, "p", prompt, "")
            for delay in (0.02, 0.05, 0.1, 0.2, 0.4, 0.8):  # until it is caught mid-way
                running = asyncio.ensure_future(ctx.generate(prompt, long))
                await asyncio.sleep(delay)
                await client.abort_request(abort_all=True)
                (out, *_) = await running
                aborted = sample_from(template, out, 0)
                if aborted.status == Status.ABORTED and aborted.response_length:
                    break
            await client.update_weights_from_disk(str(new_model), weight_version="1")
            budget = {"max_new_tokens": aborted.response_length + 6, "temperature": 0.0}
            return aborted, await continue_sample(ctx, aborted, budget, seed=5)

    aborted, cont = asyncio.run(main())
    k = aborted.response_length
    assert aborted.status == Status.ABORTED and 0 < k < 240
    assert len(aborted.rollout_log_probs) == k and aborted.token_versions() == ["0"] * k
    # the tokens it had are kept as they were; six more come from the new weights
    assert cont.response_tokens[:k] == aborted.response_tokens
    assert cont.rollout_log_probs[:k] == aborted.rollout_log_probs
    assert cont.weight_versions == ["0"] * k + ["1"] * 6 and cont.weight_version == "1"
    assert cont.status == Status.TRUNCATED and cont.metadata["continued"] == 1
    want_ids, want_lps = _hf_greedy(new_model, prompt + aborted.response_tokens, 6)
    assert cont.response_tokens[k:] == want_ids
    assert cont.rollout_log_probs[k:] == pytest.approx(want_lps, abs=1e-4)
