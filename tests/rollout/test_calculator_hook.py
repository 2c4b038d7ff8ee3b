"""The calculator rollout hook (titan_rl.rollout.calculator) and its reward
(titan_rl.rewards.tool_answer): a tool-using rollout produces exactly the pretraining
transcript, with the calculator's reply out of the loss, and the reward reads the answer
the model wrote after the reply."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from multiturn_scripted import EOS, EOS_STOP, TOK, ScriptedEngine, Turn, decode, encode

from titan_core.data.sft import arithmetic_sft_dataset
from titan_rl.config import RolloutConfig
from titan_rl.rewards.tool_answer import final_answer, score
from titan_rl.rollout.calculator import generate, with_call_stop
from titan_rl.rollout.hooks import RolloutContext
from titan_rl.rollout.tools import calculator_tool
from titan_rl.sample import Sample, Status

CLOSE = encode(")")[0]
NEWLINE = encode("\n")[0]
PARAMS = {"max_new_tokens": 16, "temperature": 1.0, "n": 1, "stop_token_ids": [EOS, NEWLINE]}


def _turn(text: str, stop: Any = EOS_STOP) -> Turn:
    return Turn(encode(text), stop if isinstance(stop, dict) else {"type": "stop", "matched": stop})


def _run(engine: ScriptedEngine, prompt: str, label: str) -> Sample:
    ctx = RolloutContext(engine, encode, decode, RolloutConfig(max_response_len=16), [EOS])
    template = Sample(0, 0, prompt, encode(prompt), label)
    return asyncio.run(generate(ctx, template, dict(PARAMS)))


def test_a_tool_rollout_is_the_pretraining_transcript_token_for_token() -> None:
    (p_ids, row) = _first_tool_row()
    prompt = decode(p_ids)
    a, b = (int(x) for x in prompt[:-1].split("+"))
    # the model's turns as the built-in engine ends them: at the ")" token, then at "\n"
    engine = ScriptedEngine([_turn(f"CALC({a}+{b})", CLOSE), _turn(f" {a + b}\n", NEWLINE)])
    s = _run(engine, prompt, str(a + b))
    assert s.status == Status.COMPLETED and s.metadata["turns"] == 2
    assert s.metadata["tool_calls"] == [{"name": "calc", "args": f"{a}+{b}", "result": str(a + b)}]
    # the pretraining row: response tokens and their loss mask, the "<eod>" aside (the RL
    # turn stops at "\n", a stop token, as the direct answers' does)
    tokens, mask = row
    assert s.response_tokens == tokens[:-1]
    assert s.loss_mask == mask[:-1]
    assert s.rollout_log_probs == [
        lp if m else 0.0
        for lp, m in zip(ScriptedEngine.logprobs(tokens[:-1]), mask[:-1], strict=True)
    ]
    assert score(prompt, s.response, str(a + b), s.metadata)["correct"] is True
    # every turn asks the engine to stop at ")" as a token, not only as a text
    assert all(CLOSE in r["params"]["stop_token_ids"] for r in engine.requests)
    assert all(")" in r["params"]["stop"] for r in engine.requests)


def _first_tool_row() -> tuple[list[int], tuple[list[int], list[int]]]:
    ds = arithmetic_sft_dataset(50, 3, 4, "plain", 40, TOK, tool_fraction=0.5)
    for i in range(len(ds)):
        row = ds[i]
        text = decode([int(t) for t in row["tokens"] if t != TOK.pad])
        if "CALC(" in text:
            n_prompt = text.index("=") + 1
            end = n_prompt + len(text[n_prompt:]) + 1  # + eod
            full = [int(t) for t in ds.tokens[i][:end]]
            mask = [int(m) for m in row["loss_mask"][n_prompt - 1 : end - 1]]
            return full[:n_prompt], (full[n_prompt:end], mask)
    raise AssertionError("no tool row")


def test_a_direct_answer_is_one_turn_scored_on_its_first_line() -> None:
    engine = ScriptedEngine([_turn("579\n", NEWLINE)])
    s = _run(engine, "123+456=", "579")
    assert s.metadata["turns"] == 1 and s.metadata["tool_calls"] == []
    assert s.loss_mask == [1] * len(s.response_tokens)
    assert score("123+456=", s.response, "579", s.metadata) == {"score": 1.0, "correct": True}
    assert score("123+456=", s.response, "580", s.metadata) == {"score": 0.0, "correct": False}


def test_the_call_stop_is_added_once_and_only_for_a_one_token_close() -> None:
    ctx = RolloutContext(ScriptedEngine(), encode, decode, RolloutConfig(), [EOS])
    once = with_call_stop(ctx, {"stop_token_ids": [EOS, CLOSE]})
    assert once["stop_token_ids"] == [EOS, CLOSE]
    assert with_call_stop(ctx, {})["stop_token_ids"] == [CLOSE]
    two_tokens = RolloutContext(ScriptedEngine(), lambda t: [7, 8], decode, RolloutConfig(), [])
    assert with_call_stop(two_tokens, {"n": 1}) == {"n": 1}


def test_the_format_matches_the_calculator_tool() -> None:
    tool = calculator_tool()
    assert tool.reply("579") == "=579" and tool.stop == (")",)
    assert tool.error_reply("boom") == "=ERROR: boom"
    assert tool.find("CALC(1+2)").group(1) == "1+2"


CALL = {"name": "calc", "args": "123+456", "result": "579"}


@pytest.mark.parametrize(
    ("response", "calls", "answer"),
    [
        ("CALC(123+456)=579 579\n", [CALL], "579"),
        ("CALC(123+456)=579 578\n", [CALL], "578"),
        # the reply alone is not an answer: the model must write it
        ("CALC(123+456)=579\n", [CALL], ""),
        ("CALC(123+456)=579", [CALL], ""),
        # the answer after the last call's reply
        ("CALC(1+2)=3 CALC(123+456)=579 579\n", [{"args": "1+2", "result": "3"}, CALL], "579"),
        # a made-up reply (no call was run) is the model's text: its first line as a whole
        ("CALC(123+456)=579 579\n", [], "CALC(123+456)=579 579"),
        ("579\n", [], "579"),
        (
            "CALC(1/0)=ERROR: ZeroDivisionError: x 5\n",
            [{"args": "1/0", "error": "ZeroDivisionError: x"}],
            "5",
        ),
    ],
)
def test_final_answer(response: str, calls: list[dict], answer: str) -> None:
    assert final_answer(response, calls) == answer


def test_the_reply_copied_without_an_answer_scores_zero() -> None:
    meta = {"tool_calls": [CALL]}
    assert score("123+456=", "CALC(123+456)=579\n", "579", meta)["score"] == 0.0
    assert score("123+456=", "CALC(123+456)=579 579\n", "579", meta)["score"] == 1.0
    assert score("123+456=", "CALC(123+456)=579 579\n", "579", {})["score"] == 0.0
