"""Tools a model calls in a multi-turn rollout, and the environment that runs them.

A :class:`Tool` finds its call in the text of a model's turn (a regex whose first group is
the argument, e.g. ``CALC(123+456)``), runs it (a Python callable, sync or async, or an HTTP
endpoint) under a timeout, and formats the reply the model reads (``=579``). Its ``stop``
strings end a model's turn right after a call (the engines' ``stop`` sampling parameter,
which SGLang and the built-in engine both honour; the stop text stays in the output ids).
:class:`ToolEnv` runs the first call of a turn; a tool that raises or times out answers the
model with an error message and the rollout goes on.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import httpx

ToolFn = Callable[[str], "str | Awaitable[str]"]


@dataclass(frozen=True)
class EnvReply:
    """An environment's answer to one model turn."""

    #: the text appended to the conversation (encoded; loss mask 0); "" appends nothing
    text: str = ""
    #: the episode is over (no tool call in the turn)
    done: bool = False
    #: what was called, for ``Sample.metadata["tool_calls"]``: ``name``, ``args`` and
    #: ``result`` or ``error``
    call: dict[str, Any] | None = None


class Env(Protocol):
    """What :func:`titan_rl.rollout.multiturn.run_multi_turn` talks to."""

    #: texts at which the engine pauses a model turn for the environment
    stop: Sequence[str]

    async def step(self, turn_text: str) -> EnvReply: ...


@dataclass(frozen=True)
class Tool:
    """A tool: ``pattern`` finds a call (group 1: its argument text), ``fn`` or ``url``
    answers it within ``timeout_s``; ``reply`` / ``error_reply`` format what the model reads.

    ``url``: the argument is POSTed as JSON ``{"name": ..., "args": ...}``; the answer is
    the JSON ``result`` field, or the body's text. A sync ``fn`` runs in a thread: on a
    timeout the rollout goes on but the thread runs to its end.
    """

    name: str
    pattern: re.Pattern[str]
    fn: ToolFn | None = None
    url: str | None = None
    timeout_s: float = 5.0
    stop: tuple[str, ...] = ()
    reply: Callable[[str], str] = str
    error_reply: Callable[[str], str] = field(default=lambda e: f"ERROR: {e}")

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.url is None):
            raise ValueError(f"tool {self.name!r}: give exactly one of fn and url")
        if self.pattern.groups < 1:
            raise ValueError(f"tool {self.name!r}: pattern needs a group for the argument")
        if self.timeout_s <= 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")

    def find(self, text: str) -> re.Match[str] | None:
        return self.pattern.search(text)

    async def call(self, args: str) -> str:
        """The tool's answer to ``args``; raises what it raised, TimeoutError past the
        timeout."""
        return await asyncio.wait_for(self._run(args), self.timeout_s)

    async def _run(self, args: str) -> str:
        if self.url is not None:
            async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                resp = await http.post(self.url, json={"name": self.name, "args": args})
                resp.raise_for_status()
                try:
                    body = resp.json()
                except ValueError:
                    return resp.text
                return (
                    str(body["result"])
                    if isinstance(body, dict) and "result" in body
                    else resp.text
                )
        assert self.fn is not None
        if asyncio.iscoroutinefunction(self.fn):
            return str(await self.fn(args))
        return str(await asyncio.to_thread(self.fn, args))


class ToolEnv:
    """Runs the first tool call found in a model's turn; ``done`` when there is none."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        if not tools:
            raise ValueError("ToolEnv needs at least one tool")
        self.tools = list(tools)
        self.stop: list[str] = list(dict.fromkeys(s for t in tools for s in t.stop))

    def _first_call(self, text: str) -> tuple[Tool, re.Match[str]] | None:
        found = [(m.start(), i, t, m) for i, t in enumerate(self.tools) if (m := t.find(text))]
        if not found:
            return None
        _, _, tool, match = min(found, key=lambda f: (f[0], f[1]))
        return tool, match

    async def step(self, turn_text: str) -> EnvReply:
        first = self._first_call(turn_text)
        if first is None:
            return EnvReply(done=True)
        tool, match = first
        args = match.group(1)
        record: dict[str, Any] = {"name": tool.name, "args": args}
        try:
            result = await tool.call(args)
        except TimeoutError:
            record["error"] = f"timed out after {tool.timeout_s:g} s"
        except Exception as e:  # whatever the tool raised goes back to the model
            record["error"] = f"{type(e).__name__}: {e}"
        else:
            record["result"] = result
            return EnvReply(tool.reply(result), call=record)
        return EnvReply(tool.error_reply(record["error"]), call=record)


# ---- a safe calculator ------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[Fraction], Fraction]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
#: the longest expression the calculator reads (bounds the size of its numbers)
MAX_EXPRESSION_CHARS = 200


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"unsupported expression {ast.unparse(node)!r} (numbers, + - * / and ( ))")


def calculate(expression: str) -> str:
    """``expression`` (numbers, ``+ - * /``, parentheses) evaluated exactly, parsed with
    ``ast`` (nothing is executed): an integer result as an integer (``579``), another to 6
    significant digits. ValueError for anything else, ZeroDivisionError for a division by 0."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    value = _value(tree.body)
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def calculator_tool(timeout_s: float = 2.0) -> Tool:
    """``CALC(expr)`` -> ``=value``: a turn pauses at the first ``)``, so the argument holds no
    parenthesis (an expression that needs them answers with an error)."""
    return Tool(
        name="calc",
        pattern=re.compile(r"CALC\(([^)]*)\)"),
        fn=calculate,
        timeout_s=timeout_s,
        stop=(")",),
        reply=lambda r: f"={r}",
        error_reply=lambda e: f"=ERROR: {e}",
    )
