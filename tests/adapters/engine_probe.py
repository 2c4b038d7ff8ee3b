"""What the adapter tests ask a running engine (SGLang's HTTP API, Titan's client)."""

from __future__ import annotations

import asyncio


def engine_logprob(url: str, prompt: list[int], response: list[int]) -> float:
    """The engine's log probability of ``response`` after ``prompt`` (a prefill only)."""
    from titan_rl.rollout.client import SGLangClient

    async def go() -> float:
        async with SGLangClient(url) as c:
            out = await c.generate_raw({
                "input_ids": prompt + response, "return_logprob": True,
                "logprob_start_len": len(prompt) - 1,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            })  # fmt: skip
        got = out[0] if isinstance(out, list) else out
        lps = [x[0] for x in got["meta_info"]["input_token_logprobs"] if x[0] is not None]
        return float(sum(lps[-len(response) :]))

    return asyncio.run(go())


def weight_version(url: str) -> str:
    """The weight version the engine reports serving."""
    from titan_rl.rollout.client import SGLangClient

    async def go() -> str:
        async with SGLangClient(url) as c:
            return (await c.get_model_info())["weight_version"]

    return asyncio.run(go())
