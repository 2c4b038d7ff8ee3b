"""The calculator transcript: how a model that calls a calculator writes an answer.

One format, shared by the pretraining rows that teach it (``data.tool_fraction``,
titan_core/data/sft.py) and the RL side that runs it (titan_rl/rollout/calculator.py, the
rollout hook; titan_rl/rewards/tool_answer.py, the reward). For the prompt ``123+456=``::

    CALC(123+456)   the model's call; the engine pauses the turn at ")"
    =579            the calculator's reply, appended by the environment (the model never
                    generates it: no loss in pretraining, loss mask 0 in RL)
     579\\n<eod>     the model's final answer: a space, the answer, end of line / text

The call and reply match titan_rl.rollout.tools.calculator_tool (``CALC(expr)`` ->
``=value``); a test pins that run_multi_turn with it produces exactly these tokens.
"""

from __future__ import annotations

from typing import NamedTuple

#: what the model writes to call the calculator, around the expression
CALL_OPEN, CALL_CLOSE = "CALC(", ")"
#: what the calculator's reply starts with (``=579``)
REPLY_PREFIX = "="
#: what the model writes between the calculator's reply and its final answer
ANSWER_SEPARATOR = " "


class Segment(NamedTuple):
    """A piece of a transcript and whether the model writes it (trained) or the
    environment does (not trained)."""

    text: str
    model_written: bool


def call_text(expression: str) -> str:
    """The model's call: ``CALC(123+456)``."""
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}"


def reply_text(result: str) -> str:
    """The calculator's reply to a call: ``=579``."""
    return f"{REPLY_PREFIX}{result}"


def error_reply_text(error: str) -> str:
    """The calculator's reply to a call it could not answer: ``=ERROR: ...``."""
    return f"{REPLY_PREFIX}ERROR: {error}"


def tool_transcript(expression: str, answer: str, end: str = "\n") -> list[Segment]:
    """The response of a model that calls the calculator on ``expression`` and then writes
    ``answer`` (the end of text token, when there is one, follows ``end``)."""
    return [
        Segment(call_text(expression), True),
        Segment(reply_text(answer), False),
        Segment(f"{ANSWER_SEPARATOR}{answer}{end}", True),
    ]


def answer_after_reply(response: str, expression: str, reply: str) -> str | None:
    """What the model wrote after the calculator's ``reply`` to its last call of
    ``expression`` (the separator removed, first line, stripped); None when the response
    has no such call followed by that reply."""
    call = call_text(expression)
    at = response.rfind(call + reply)
    if at < 0:
        return None
    tail = response[at + len(call) + len(reply) :]
    if tail.startswith(ANSWER_SEPARATOR):
        tail = tail[len(ANSWER_SEPARATOR) :]
    lines = tail.strip().split("\n", 1)
    return lines[0].strip()
