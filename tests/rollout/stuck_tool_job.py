"""A multi-turn rollout whose sync tool never returns, as a job of its own (run by
tests/rollout/test_multiturn_stuck_tools.py): ``N`` samples at once, each a model turn that
calls the tool, the error reply, and a final turn; N is above asyncio's default executor's
thread count. It then times one ``asyncio.to_thread`` call (the driver's other users of that
executor), prints a JSON line with the time it printed it, and ends its event loop and
returns: the process must exit right after."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

from multiturn_scripted import EOS, EOS_STOP, ScriptedEngine, Turn, decode, encode, stop_at
from stuck_tools import never_returns

from titan_rl.config import RolloutConfig
from titan_rl.rollout.hooks import RolloutContext
from titan_rl.rollout.multiturn import run_multi_turn
from titan_rl.rollout.tools import Tool, ToolEnv, stuck_calls
from titan_rl.sample import Sample

PROMPT = encode("Q: ")
CALL, ANSWER = encode("HANG(x)"), [*encode("ok"), EOS]


def respond(input_ids: list[int]) -> Turn:
    if len(input_ids) == len(PROMPT):
        return Turn(CALL, stop_at(")"))
    return Turn(ANSWER, EOS_STOP)


async def main(n: int) -> None:
    tool = Tool("hang", re.compile(r"HANG\(([^)]*)\)"), fn=never_returns, timeout_s=0.3,
                stop=(")",))  # fmt: skip
    ctx = RolloutContext(ScriptedEngine(respond=respond), encode, decode, RolloutConfig(), [EOS])
    params = {"max_new_tokens": 16, "temperature": 0.0, "n": 1, "stop_token_ids": [EOS]}
    started = time.monotonic()
    samples = await asyncio.gather(*(
        run_multi_turn(ctx, Sample(0, i, "Q: ", list(PROMPT), "ok"), params, ToolEnv([tool]), 3, 64)
        for i in range(n)
    ))  # fmt: skip
    rollout_s = time.monotonic() - started
    started = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.to_thread(lambda: None), 5.0)
        to_thread_s: float | None = time.monotonic() - started
    except TimeoutError:
        to_thread_s = None  # the default executor is full of stuck calls
    calls = [c for s in samples for c in s.metadata["tool_calls"]]
    out = {
        "samples": len(samples),
        "completed": sum(s.status.value == "completed" for s in samples),
        "timeouts": sum(bool(c.get("timed_out")) for c in calls),
        "stuck": stuck_calls(),
        "rollout_s": rollout_s,
        "to_thread_s": to_thread_s,
        "done_at": time.time(),
    }
    print(json.dumps(out), flush=True)  # the job's results; then asyncio.run ends the loop


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
