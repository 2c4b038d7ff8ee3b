"""A multi-turn rollout on the built-in engine (tiny random model, byte tokenizer): the
tokens trained are the ids the engine generated, turn by turn, even where decoding them and
encoding the text again gives other tokens."""

from __future__ import annotations

import asyncio
from typing import Any

from multiturn_scripted import decode, encode

from titan_rl.actors.server import ServerProcess
from titan_rl.config import RolloutConfig
from titan_rl.rollout import SGLangClient
from titan_rl.rollout.engine_api import GenerateOutput
from titan_rl.rollout.hooks import RolloutContext
from titan_rl.rollout.multiturn import run_multi_turn
from titan_rl.rollout.tools import EnvReply
from titan_rl.sample import Sample
from titan_rl.trainer.batch import pack_samples

#: a turn ends at any token above 127 (a lone byte that is not UTF-8, or no byte at all)
STOP_IDS = list(range(128, 300))


class Recorder:
    """Forwards to the engine's client and keeps every request and answer."""

    def __init__(self, client: SGLangClient) -> None:
        self.client, self.base_url = client, client.base_url
        self.calls: list[tuple[list[int], GenerateOutput]] = []

    async def generate(self, ids: list[int], params: dict[str, Any], **kw: Any) -> Any:
        out = await self.client.generate(ids, params, **kw)
        self.calls.append((list(ids), out))
        return out


class Echo:
    """Answers each of the first ``replies`` turns with ``reply``, then says done."""

    stop: tuple[str, ...] = ()

    def __init__(self, replies: int) -> None:
        self.left, self.sent = replies, []

    async def step(self, turn_text: str) -> EnvReply:
        if not self.left:
            return EnvReply(done=True)
        self.left -= 1
        reply = f"<{len(self.sent)}:é>"
        self.sent.append(reply)
        return EnvReply(reply, call={"name": "echo", "args": turn_text, "result": reply})


def test_trained_tokens_are_the_engines_ids(engine: ServerProcess) -> None:
    async def main() -> tuple[Sample, Recorder, Echo]:
        async with SGLangClient(engine.url) as client:
            rec, env = Recorder(client), Echo(replies=2)
            ctx = RolloutContext(rec, encode, decode, RolloutConfig(), STOP_IDS)  # type: ignore[arg-type]
            params = {"max_new_tokens": 12, "temperature": 1.0, "n": 1,
                      "stop_token_ids": STOP_IDS, "sampling_seed": 11}  # fmt: skip
            prompt = encode("Q: ")
            s = await run_multi_turn(ctx, Sample(0, 0, "Q: ", prompt, ""), params, env, 5, 200)
            return s, rec, env

    s, rec, env = asyncio.run(main())
    outs = [out for _, out in rec.calls]
    assert len(outs) == s.metadata["turns"] >= 1
    expected, mask, lps = [], [], []
    for k, (sent, out) in enumerate(rec.calls):
        assert sent == s.prompt_tokens + expected  # token in: the ids so far
        expected += out.output_ids
        mask += [1] * len(out.output_ids)
        lps += out.output_logprobs
        if k < len(env.sent) and k < len(outs) - 1:
            reply = encode(env.sent[k])
            expected, mask, lps = (
                expected + reply,
                mask + [0] * len(reply),
                lps + [0.0] * len(reply),
            )
    model_ids = [t for out in outs for t in out.output_ids]
    assert encode(decode(model_ids)) != model_ids  # text would not give these tokens back
    assert s.response_tokens == expected and s.loss_mask == mask
    assert s.rollout_log_probs == lps
    batch = pack_samples([s], pad_id=0)
    assert batch.tokens[0, : len(s.tokens)].tolist() == s.prompt_tokens + expected
