"""Exact match on the answer a model writes after calling the calculator
(``reward.type: custom``, ``reward.custom_path: titan_rl.rewards.tool_answer:score``;
examples/math_tool.yaml).

The answer is what the model wrote after the calculator's reply to its last call
(titan_core/data/calc_transcript.py), or the whole response's first line when it called
nothing. The calculator's reply is the environment's text, not the model's answer: a
response that stops right after ``=579`` answered nothing. Calls are read from the sample's
``metadata["tool_calls"]`` (what the rollout ran), so text the model made up to look like a
reply is never taken for one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from titan_core.data.calc_transcript import answer_after_reply, error_reply_text, reply_text
from titan_rl.rewards.config import DEFAULT_STOP_STRINGS
from titan_rl.rewards.scorer import first_line_answer


def final_answer(response: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> str:
    """The model's final answer in ``response`` given the calls the rollout ran."""
    if not tool_calls:
        return first_line_answer(response, DEFAULT_STOP_STRINGS)
    last = tool_calls[-1]
    result = last.get("result")
    failed = result is None  # the reply was an error message
    reply = error_reply_text(str(last.get("error", ""))) if failed else reply_text(str(result))
    answer = answer_after_reply(response, str(last.get("args", "")), reply)
    if answer is None:
        return ""
    return first_line_answer(answer, DEFAULT_STOP_STRINGS)


def score(prompt: str, response: str, label: str, metadata: dict) -> dict[str, Any]:
    """1 when the final answer equals the label; ``correct`` for accuracy metrics."""
    answer = final_answer(response, metadata.get("tool_calls") or ())
    correct = bool(answer) and answer == str(label).strip()
    return {"score": float(correct), "correct": correct}
