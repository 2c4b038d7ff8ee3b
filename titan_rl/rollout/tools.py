"""Tools a model calls in a multi-turn rollout, and the environment that runs them.

A :class:`Tool` finds its call in the text of a model's turn (a regex whose first group is
the argument, e.g. ``CALC(123+456)``), runs it (a Python callable, sync or async, or an HTTP
endpoint) under a timeout, and formats the reply the model reads (``=579``). Its ``stop``
strings end a model's turn right after a call (the engines' ``stop`` sampling parameter,
which SGLang and the built-in engine both honour; the stop text stays in the output ids).
:class:`ToolEnv` runs the first call of a turn; a tool that raises or times out answers the
model with an error message and the rollout goes on (``timed_out`` in the call's record).

Sync tool functions never run on asyncio's default executor: a call that never returns would
hold one of its few threads for good (a handful of them starve every ``asyncio.to_thread`` of
the driver's loop, the engine recovery's included), and the interpreter joins its threads at
exit, so the job would never end. They run on :class:`ToolWorkers`: daemon threads of their own
(``isolation="thread"``; a stuck call's thread runs on, counted by :func:`stuck_calls`, but
holds neither the driver nor the exit), or killable worker processes
(``isolation="process"``; a stuck call is killed with its worker).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import itertools
import multiprocessing
import operator
import os
import pickle
import re
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, Protocol

import httpx
from pebble import ProcessExpired, ProcessPool

from titan_core.net import client_tls

ToolFn = Callable[[str], "str | Awaitable[str]"]
#: where a tool's ``fn`` runs (see :class:`ToolWorkers`)
Isolation = Literal["thread", "process"]


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


# ---- where sync tool functions run ----------------------------------------------------------


class _Slots:
    """At most ``limit`` threads of one tool alive at once (stuck ones included); a caller
    past the limit waits, on its own event loop, for a finishing thread to hand it its slot."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live = 0
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    async def acquire(self) -> None:
        with self._lock:
            if self.live < self.limit and not self._waiters:
                self.live += 1
                return
            loop = asyncio.get_running_loop()
            granted: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, granted))
        try:
            await granted
        except asyncio.CancelledError:
            with self._lock:
                try:
                    self._waiters.remove((loop, granted))
                except ValueError:  # a slot was handed over: give it on (see _grant)
                    if granted.done() and not granted.cancelled():
                        self._release_locked()
            raise

    def release(self) -> None:
        """A thread ended (any thread): its slot goes to the first waiter, or back."""
        with self._lock:
            self._release_locked()

    def _release_locked(self) -> None:
        while self._waiters:
            loop, granted = self._waiters.popleft()
            try:
                loop.call_soon_threadsafe(self._grant, granted)
                return
            except RuntimeError:  # that waiter's loop is closed: the next one
                continue
        self.live -= 1

    def _grant(self, granted: asyncio.Future[None]) -> None:
        if granted.done():  # the waiter gave up (its timeout) before its slot came
            self.release()
        else:
            granted.set_result(None)


def _settle(done: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if not done.done():  # else the caller timed out: nobody reads the outcome
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)


def _run_in_worker(fn: ToolFn, args: str) -> str:
    """A tool worker process's call: ``fn(args)``, an ``async def`` on the worker's own loop."""
    out = fn(args)
    if inspect.isawaitable(out):

        async def wait() -> Any:
            return await out

        out = asyncio.run(wait())
    return str(out)


def _importable(fn: Any) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return True


class ToolWorkers:
    """Where tools' ``fn`` run, apart from asyncio's default executor.

    ``thread`` (sync functions): each call on a daemon thread of its own, at most
    ``max_threads`` per tool alive at once, stuck ones included; past that a call waits for
    one to end, within its timeout. A call past its timeout cannot be stopped: its thread
    runs on until the function returns (:attr:`stuck` counts them) but holds neither the
    event loop's executor nor the interpreter's exit, and another tool's calls go on.

    ``process`` (sync or ``async def``): calls in up to ``max_processes`` worker processes
    (pebble, from a forkserver, as the reward workers are), started on first use; a call past
    its timeout is killed with its worker, which is replaced. Whatever the function does
    (spins in pure Python, blocks in C) costs its worker for ``timeout_s`` at most. The
    function must be importable by name (a module-level function) and runs without the
    driver's state.
    """

    def __init__(self, max_threads: int = 32, max_processes: int | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.max_processes = max_processes or max(2, min(8, os.cpu_count() or 1))
        self._slots: dict[str, _Slots] = {}
        self._lock = threading.Lock()
        self._stuck = 0
        self._pool: ProcessPool | None = None
        self._names = itertools.count()
        _ALL_WORKERS.add(self)

    @property
    def stuck(self) -> int:
        """Thread calls that ran past their timeout and still run."""
        return self._stuck

    async def run(self, tool: Tool, args: str) -> str:
        """``tool.fn(args)`` by ``tool.isolation`` (the caller's timeout cancels it)."""
        assert tool.fn is not None
        if tool.isolation == "process":
            return await self._in_process(tool.fn, args, tool.timeout_s)
        return str(await self._in_thread(tool.name, tool.fn, args))

    # ---- threads --------------------------------------------------------------------------
    async def _in_thread(self, name: str, fn: ToolFn, args: str) -> Any:
        with self._lock:
            slots = self._slots.setdefault(name, _Slots(self.max_threads))
        await slots.acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        state = {"finished": False, "abandoned": False}

        def work() -> None:
            try:
                ok, value = True, fn(args)
            except Exception as e:
                ok, value = False, e
            except BaseException as e:  # SystemExit and the like end the call, not the job
                ok, value = False, RuntimeError(f"{type(e).__name__}: {e}")
            with self._lock:
                state["finished"] = True
                if state["abandoned"]:
                    self._stuck -= 1
            slots.release()
            with contextlib.suppress(RuntimeError):  # RuntimeError: the caller's loop closed
                loop.call_soon_threadsafe(_settle, done, ok, value)

        thread = threading.Thread(
            target=work, name=f"titan-tool-{name}-{next(self._names)}", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            slots.release()
            raise
        try:
            return await done
        except asyncio.CancelledError:
            with self._lock:
                if not state["finished"]:
                    state["abandoned"] = True
                    self._stuck += 1
            raise

    # ---- processes ------------------------------------------------------------------------
    def _process_pool(self) -> ProcessPool:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("forkserver")
                # workers fork with this module imported (no effect once the forkserver runs)
                ctx.set_forkserver_preload([__name__])
                self._pool = ProcessPool(max_workers=self.max_processes, context=ctx)
            return self._pool

    async def _in_process(self, fn: ToolFn, args: str, timeout_s: float) -> str:
        future = self._process_pool().schedule(_run_in_worker, args=(fn, args), timeout=timeout_s)
        try:
            # cancelling this coroutine (the caller's timeout) cancels the call: pebble kills
            # a running one's worker
            return await asyncio.wrap_future(future)
        except FutureTimeout:
            raise TimeoutError(f"timed out after {timeout_s:g} s") from None
        except ProcessExpired as e:
            raise RuntimeError(f"the tool's worker process died (exit code {e.exitcode})") from None

    def close(self) -> None:
        """Stop the worker processes (a running call is killed); threads are left to end."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()


#: every ToolWorkers alive, for :func:`stuck_calls`
_ALL_WORKERS: weakref.WeakSet[ToolWorkers] = weakref.WeakSet()
#: the workers of a tool that names none
DEFAULT_WORKERS = ToolWorkers()


def stuck_calls() -> int:
    """Sync tool calls of this process that ran past their timeout and still run (threads
    cannot be stopped; ``isolation="process"`` kills them instead)."""
    return sum(w.stuck for w in list(_ALL_WORKERS))


def close_tool_workers() -> None:
    """Stop every ToolWorkers' worker processes (the job's end)."""
    for w in list(_ALL_WORKERS):
        w.close()


@dataclass(frozen=True)
class Tool:
    """A tool: ``pattern`` finds a call (group 1: its argument text), ``fn`` or ``url``
    answers it within ``timeout_s``; ``reply`` / ``error_reply`` format what the model reads.

    ``url``: the argument is POSTed as JSON ``{"name": ..., "args": ...}``; the answer is
    the JSON ``result`` field, or the body's text. ``fn`` runs by ``isolation`` on
    ``workers`` (:data:`DEFAULT_WORKERS` when None; see :class:`ToolWorkers`): ``"thread"``
    (the default), a sync ``fn`` on a daemon thread, an ``async def`` on the event loop,
    where the timeout cancels it; a stuck sync call's thread runs on (:func:`stuck_calls`)
    but holds neither the driver nor the job's exit. ``"process"``: in a worker process,
    killed past the timeout, for a function that may spin or block for good (running code
    the model wrote, a C library); ``fn`` must then be a module-level function.
    """

    name: str
    pattern: re.Pattern[str]
    fn: ToolFn | None = None
    url: str | None = None
    timeout_s: float = 5.0
    stop: tuple[str, ...] = ()
    reply: Callable[[str], str] = str
    error_reply: Callable[[str], str] = field(default=lambda e: f"ERROR: {e}")
    isolation: Isolation = "thread"
    workers: ToolWorkers | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.url is None):
            raise ValueError(f"tool {self.name!r}: give exactly one of fn and url")
        if self.pattern.groups < 1:
            raise ValueError(f"tool {self.name!r}: pattern needs a group for the argument")
        if self.timeout_s <= 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")
        if self.isolation not in ("thread", "process"):
            raise ValueError(
                f"tool {self.name!r}: isolation must be 'thread' or 'process', got "
                f"{self.isolation!r}"
            )
        if self.isolation == "process" and self.fn is not None and not _importable(self.fn):
            raise ValueError(
                f"tool {self.name!r}: isolation='process' runs fn in a worker process, which "
                f"imports it by name; {self.fn!r} is not a module-level function (a lambda, a "
                "closure or a bound method is not): define it at a module's top level"
            )

    def find(self, text: str) -> re.Match[str] | None:
        return self.pattern.search(text)

    async def call(self, args: str) -> str:
        """The tool's answer to ``args``; raises what it raised, TimeoutError past the
        timeout (in a worker process: past ``timeout_s`` of running there, the wait for a
        free worker not counted, as for reward workers)."""
        if self.fn is not None and self.isolation == "process":
            return await (self.workers or DEFAULT_WORKERS).run(self, args)
        return await asyncio.wait_for(self._run(args), self.timeout_s)

    async def _run(self, args: str) -> str:
        if self.url is not None:
            async with httpx.AsyncClient(timeout=self.timeout_s, verify=client_tls()) as http:
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
        if self.isolation == "thread" and asyncio.iscoroutinefunction(self.fn):
            return str(await self.fn(args))
        return await (self.workers or DEFAULT_WORKERS).run(self, args)


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
            record["timed_out"] = True
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
