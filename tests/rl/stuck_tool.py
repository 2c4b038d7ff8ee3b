"""A rollout hook whose tool never returns (tests/rl/test_tool_faults_e2e.py): every model
turn with any text is a call of a sync tool stuck for good, answered "=?" after its 0.2 s
timeout; two turns per sample."""

from __future__ import annotations

import re
import threading
from typing import Any

from titan_rl.rollout.hooks import RolloutContext
from titan_rl.rollout.multiturn import run_multi_turn
from titan_rl.rollout.tools import Tool, ToolEnv
from titan_rl.sample import Sample


def never_returns(args: str) -> str:
    threading.Event().wait()
    return "never"


STUCK = Tool(
    "stuck", re.compile(r"(?s)(.+)"), fn=never_returns, timeout_s=0.2,
    error_reply=lambda e: "=?",
)  # fmt: skip


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    per_turn = int(sampling_params.get("max_new_tokens", ctx.cfg.max_response_len))
    return await run_multi_turn(
        ctx, sample, sampling_params, ToolEnv([STUCK]), max_turns=2,
        max_total_tokens=2 * per_turn,
    )  # fmt: skip
