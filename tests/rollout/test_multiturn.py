"""Multi-turn rollouts against a scripted engine (bookkeeping: token in / token out, loss
masks, logprobs, tool calls, limits) and the tools they call."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from multiturn_scripted import EOS, EOS_STOP, ScriptedEngine, Turn, decode, encode, stop_at

from titan_rl.config import RolloutConfig
from titan_rl.rollout.hooks import RolloutContext
from titan_rl.rollout.multiturn import run_multi_turn
from titan_rl.rollout.tools import EnvReply, Tool, ToolEnv, calculate, calculator_tool
from titan_rl.sample import Sample, Status
from titan_rl.trainer.batch import pack_samples

PROMPT = "Q: 123+456 then *2? A: "
GREEDY = {"max_new_tokens": 32, "temperature": 0.0, "n": 1, "stop_token_ids": [EOS]}


def ctx_for(engine: ScriptedEngine) -> RolloutContext:
    return RolloutContext(engine, encode, decode, RolloutConfig(), [EOS])


def template() -> Sample:
    return Sample(0, 0, PROMPT, encode(PROMPT), "1158", metadata={"src": "t"})


def run(engine: ScriptedEngine, env: Any, max_turns: int = 5, max_total: int = 256,
        params: dict[str, Any] | None = None) -> Sample:  # fmt: skip
    return asyncio.run(
        run_multi_turn(ctx_for(engine), template(), params or GREEDY, env, max_turns, max_total)
    )


def test_three_turns_with_a_calculator_against_hand_computed_masks_and_logprobs() -> None:
    t1, t2, t3 = encode("CALC(123+456)"), encode("CALC(579*2)"), [*encode("1158"), EOS]
    engine = ScriptedEngine([Turn(t1, stop_at(")")), Turn(t2, stop_at(")")), Turn(t3, EOS_STOP)])
    s = run(engine, ToolEnv([calculator_tool()]))

    r1, r2 = encode("=579"), encode("=1158")
    assert s.response_tokens == t1 + r1 + t2 + r2 + t3
    assert s.loss_mask == [1] * 13 + [0] * 4 + [1] * 11 + [0] * 5 + [1] * 5
    lp = ScriptedEngine.logprobs
    assert s.rollout_log_probs == lp(t1) + [0.0] * 4 + lp(t2) + [0.0] * 5 + lp(t3)
    assert s.response == "CALC(123+456)=579CALC(579*2)=11581158"
    assert s.status == Status.COMPLETED and s.weight_version == "3"
    assert s.metadata == {
        "src": "t",
        "turns": 3,
        "tool_calls": [
            {"name": "calc", "args": "123+456", "result": "579"},
            {"name": "calc", "args": "579*2", "result": "1158"},
        ],
        "stop_reason": "done",
    }
    # token in: each turn continues from the ids so far; the turn pauses right after ")"
    p = encode(PROMPT)
    assert [r["input_ids"] for r in engine.requests] == [p, p + t1 + r1, p + t1 + r1 + t2 + r2]
    assert all(
        r["params"]["stop"] == [")"] and r["params"]["no_stop_trim"] for r in engine.requests
    )
    assert [r["params"]["max_new_tokens"] for r in engine.requests] == [32, 32, 32]
    assert all(r["logprob"] and r["extra"] == {} for r in engine.requests)

    # packed: the tool's replies are fed but carry no loss and no rollout logprob
    batch = pack_samples([s], pad_id=0)
    start = len(p) - 1
    assert batch.tokens[0, : len(s.tokens)].tolist() == s.tokens
    assert batch.response_mask[0, :start].sum() == 0
    assert batch.response_mask[0, start : start + 38].tolist() == [float(m) for m in s.loss_mask]
    assert batch.response_mask[0, start + 38 :].sum() == 0
    assert batch.rollout_logprobs[0, start : start + 38].tolist() == pytest.approx(
        s.rollout_log_probs
    )


def test_trained_tokens_are_the_generated_ids_even_where_text_round_trips_differently() -> None:
    # invalid UTF-8 bytes and the pad id: decode -> encode gives other tokens
    odd = [0xC3, 0x28, 0xE2, 0x82, 257, *encode("CALC(2+2)")]
    assert encode(decode(odd)) != odd
    last = [0xF0, 0x9F, 0x98, EOS]
    engine = ScriptedEngine([Turn(odd, stop_at(")")), Turn(last, EOS_STOP)])
    s = run(engine, ToolEnv([calculator_tool()]))
    assert s.response_tokens == odd + encode("=4") + last
    assert s.metadata["tool_calls"] == [{"name": "calc", "args": "2+2", "result": "4"}]
    batch = pack_samples([s], pad_id=0)
    assert batch.tokens[0, : len(s.tokens)].tolist() == encode(PROMPT) + odd + encode("=4") + last
    assert engine.requests[1]["input_ids"] == encode(PROMPT) + odd + encode("=4")


async def _boom(args: str) -> str:
    raise RuntimeError(f"no {args}")


async def _hang(args: str) -> str:
    await asyncio.sleep(3600)
    return "never"


def test_a_failing_and_a_hanging_tool_answer_errors_and_the_rollout_completes() -> None:
    tools = [
        Tool("boom", re.compile(r"BOOM\(([^)]*)\)"), fn=_boom, stop=(")",)),
        Tool("hang", re.compile(r"HANG\(([^)]*)\)"), fn=_hang, timeout_s=0.2, stop=(")",)),
    ]
    t1, t2, t3 = encode("BOOM(x)"), encode("HANG(y)"), [*encode("ok"), EOS]
    engine = ScriptedEngine([Turn(t1, stop_at(")")), Turn(t2, stop_at(")")), Turn(t3, EOS_STOP)])
    started = time.monotonic()
    s = run(engine, ToolEnv(tools))
    assert time.monotonic() - started < 60  # the hanging tool did not hold the rollout
    assert s.status == Status.COMPLETED and s.metadata["turns"] == 3
    assert s.metadata["tool_calls"] == [
        {"name": "boom", "args": "x", "error": "RuntimeError: no x"},
        {"name": "hang", "args": "y", "error": "timed out after 0.2 s", "timed_out": True},
    ]
    e1, e2 = encode("ERROR: RuntimeError: no x"), encode("ERROR: timed out after 0.2 s")
    assert s.response_tokens == t1 + e1 + t2 + e2 + t3
    assert s.loss_mask == [1] * len(t1) + [0] * len(e1) + [1] * len(t2) + [0] * len(e2) + [1] * 3


class _ToolServer(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["args"] == "slow":
            time.sleep(2.0)
        data = json.dumps({"result": body["args"].upper()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def tool_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ToolServer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/tool"
    server.shutdown()
    server.server_close()


def test_http_tool_answers_and_times_out(tool_server: str) -> None:
    tool = Tool("up", re.compile(r"UP\(([^)]*)\)"), url=tool_server, timeout_s=0.5)
    env = ToolEnv([tool])
    ok = asyncio.run(env.step("x UP(abc) y"))
    assert ok == EnvReply("ABC", call={"name": "up", "args": "abc", "result": "ABC"})
    slow = asyncio.run(env.step("UP(slow)"))
    assert not slow.done and slow.text.startswith("ERROR: ")
    assert slow.call is not None and slow.call["args"] == "slow" and "result" not in slow.call
    assert asyncio.run(env.step("no call here")) == EnvReply(done=True)


def test_max_turns_stops_without_feeding_a_reply_nobody_answers() -> None:
    call = encode("CALC(1+1)")
    engine = ScriptedEngine([Turn(call, stop_at(")")) for _ in range(3)])
    s = run(engine, ToolEnv([calculator_tool()]), max_turns=2)
    assert s.status == Status.TRUNCATED and s.metadata["stop_reason"] == "max_turns"
    assert s.metadata["turns"] == 2 and len(s.metadata["tool_calls"]) == 2
    assert s.response_tokens == call + encode("=2") + call  # ends with the model's tokens
    assert s.loss_mask == [1] * 9 + [0] * 2 + [1] * 9


def test_the_token_budget_caps_each_turn_and_truncates() -> None:
    call = encode("CALC(1+1)")  # 9 tokens, reply "=2": 2 tokens
    engine = ScriptedEngine([Turn(call, stop_at(")")), Turn(call, stop_at(")"))])
    s = run(engine, ToolEnv([calculator_tool()]), max_total=16)
    # turn 2 may use the 16 - 11 tokens left and is cut there
    assert [r["params"]["max_new_tokens"] for r in engine.requests] == [16, 5]
    assert s.response_tokens == call + encode("=2") + call[:5]
    assert s.status == Status.TRUNCATED and s.metadata["stop_reason"] == "max_total_tokens"
    assert len(s.loss_mask) == len(s.rollout_log_probs) == 16


def test_a_reply_that_leaves_no_room_is_not_fed() -> None:
    call = encode("CALC(1+1)")
    engine = ScriptedEngine([Turn(call, stop_at(")"))])
    s = run(engine, ToolEnv([calculator_tool()]), max_total=10)
    assert s.response_tokens == call and s.loss_mask == [1] * 9
    assert s.status == Status.TRUNCATED and s.metadata["stop_reason"] == "max_total_tokens"


def test_a_pause_without_a_call_continues_the_turn() -> None:
    # ")" in plain text pauses the engine; without a call in it the model goes on
    t1, t2 = encode("(so)"), [*encode(" 7"), EOS]
    engine = ScriptedEngine([Turn(t1, stop_at(")")), Turn(t2, EOS_STOP)])
    s = run(engine, ToolEnv([calculator_tool()]))
    assert s.response_tokens == t1 + t2 and s.loss_mask == [1] * len(t1 + t2)
    assert s.metadata["tool_calls"] == [] and s.metadata["turns"] == 2
    assert s.status == Status.COMPLETED and s.metadata["stop_reason"] == "done"


def test_run_multi_turn_refuses_n_above_one() -> None:
    with pytest.raises(ValueError, match="n=1"):
        run(ScriptedEngine([]), ToolEnv([calculator_tool()]), params={**GREEDY, "n": 2})


@pytest.mark.parametrize(
    ("expr", "value"),
    [("123+456", "579"), ("7/2", "3.5"), ("(1+2)*3", "9"), ("-4*-2", "8"), (" 10 - 2.5 ", "7.5"),
     ("1/3", "0.333333"), ("99999999999*99999999999", "9999999999800000000001")],
)  # fmt: skip
def test_calculator_values(expr: str, value: str) -> None:
    assert calculate(expr) == value


@pytest.mark.parametrize(
    "expr", ["2**10", "__import__('os')", "abs(-1)", "1 if 1 else 2", "x+1", "", "1+", "'a'*3"]
)
def test_calculator_refuses_anything_but_arithmetic(expr: str) -> None:
    with pytest.raises(ValueError):
        calculate(expr)


def test_calculator_errors_go_back_to_the_model() -> None:
    env = ToolEnv([calculator_tool()])
    zero = asyncio.run(env.step("CALC(1/0)"))
    assert zero.text.startswith("=ERROR: ZeroDivisionError") and not zero.done
    nested = asyncio.run(env.step("CALC((1+2)"))
    assert nested.text.startswith("=ERROR: ValueError") and nested.call is not None
    assert asyncio.run(env.step("CALC(1+2)")).text == "=3"


def test_a_tool_needs_exactly_one_way_to_run() -> None:
    with pytest.raises(ValueError, match="exactly one of fn and url"):
        Tool("t", re.compile(r"T\((.*)\)"))
    with pytest.raises(ValueError, match="group"):
        Tool("t", re.compile(r"T"), fn=str)
