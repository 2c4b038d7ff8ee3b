"""A rollout hook in which the model may call a calculator before it answers
(``rollout.generate_fn: titan_rl.rollout.calculator:generate``; examples/math_tool.yaml).

The model's turn pauses at the ``)`` of a ``CALC(expr)`` call, the calculator's ``=value``
is appended (loss mask 0) and the model goes on to write its final answer: the transcript
of titan_core/data/calc_transcript.py, which the base policy was pretrained on. A response
without a call is a single turn, as the built-in rollout's.

The pause is asked for twice: as the stop text ``)`` (run_multi_turn sends the tool's stop
strings; the GRPO job's engines load the run's tokenizer to match them) and, when ``)`` is
one token, as a stop token id too, which an engine checks without decoding its output.
"""

from __future__ import annotations

from typing import Any

from titan_core.data.calc_transcript import CALL_CLOSE
from titan_rl.rollout.hooks import RolloutContext
from titan_rl.rollout.multiturn import run_multi_turn
from titan_rl.rollout.tools import ToolEnv, calculator_tool
from titan_rl.sample import Sample

#: model turns: a call, the answer, and one more call the policy may try (a third turn
#: ends the rollout, truncated, if it calls again)
MAX_TURNS = 3
#: the response's token budget (model's and calculator's) in per-turn limits
#: (``rollout.max_response_len``): a call and an answer fit in two
BUDGET_TURNS = 2


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """``sample`` answered with the calculator available (one sample: ``n`` = 1)."""
    per_turn = int(sampling_params.get("max_new_tokens", ctx.cfg.max_response_len))
    return await run_multi_turn(
        ctx,
        sample,
        with_call_stop(ctx, sampling_params),
        ToolEnv([calculator_tool()]),
        max_turns=MAX_TURNS,
        max_total_tokens=BUDGET_TURNS * per_turn,
    )


def with_call_stop(ctx: RolloutContext, sampling_params: dict[str, Any]) -> dict[str, Any]:
    """``sampling_params`` with the token of ``)`` among the stop token ids, when the
    tokenizer writes ``)`` as one token (see the module's doc)."""
    close = ctx.encode(CALL_CLOSE)
    if len(close) != 1:
        return sampling_params
    ids = list(sampling_params.get("stop_token_ids") or [])
    return {**sampling_params, "stop_token_ids": list(dict.fromkeys([*ids, close[0]]))}
