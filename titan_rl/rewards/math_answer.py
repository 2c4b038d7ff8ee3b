"""Math answers: extraction (boxed, "answer is X", last number) and a timeout-safe math-verify.

math-verify bounds its own parsing and comparison time with ``signal.alarm``, which works in
the main thread only. Off the main thread (a threaded server, a Ray actor's thread pool) the
check runs in a helper process instead, with a wall-clock backstop that kills it if sympy
gets stuck in C code where no signal can interrupt it.
"""

from __future__ import annotations

import math
import multiprocessing
import re
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pebble import ProcessExpired, ProcessPool

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_SPACE = re.compile(r"\\boxed +([^\s$]+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces) or ``\\boxed x``; None if none."""
    found: tuple[int, str] | None = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = (m.start(), text[m.end() : i - 1])
    for m in _BOXED_SPACE.finditer(text):
        if found is None or m.start() > found[0]:
            found = (m.start(), m.group(1))
    return found[1].strip() if found is not None else None


def _strip_math(s: str) -> str:
    s = s.strip().rstrip(".").strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s.rstrip(".").strip()


def extract_math_answer(response: str) -> tuple[str | None, str]:
    """(answer, how): how is "boxed", "answer_is", "last_number" or "none"."""
    boxed = extract_boxed(response)
    if boxed:
        return boxed, "boxed"
    said = _ANSWER_IS.findall(response)
    if said:
        ans = _strip_math(said[-1])
        if ans:
            return ans, "answer_is"
    numbers = _NUMBER.findall(response)
    if numbers:
        return numbers[-1].replace(",", "").replace(" ", ""), "last_number"
    return None, "none"


def _wrap(s: str) -> str:
    """math-verify extracts from LaTeX environments; give bare answers a \\boxed{} one."""
    return s if ("\\boxed" in s or "$" in s) else "\\boxed{" + s + "}"


def _normal(s: str) -> str:
    return re.sub(r"\s+", "", _strip_math(s))


def verify_answer_unsafe(label: str, answer: str, timeout_s: float = 5.0) -> bool:
    """math-verify equivalence of ``answer`` to ``label``; uses signals: main thread only."""
    from math_verify import parse, verify

    t = max(1, math.ceil(timeout_s))
    gold = parse(_wrap(label), parsing_timeout=t)
    pred = parse(_wrap(answer), parsing_timeout=t)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=t))


class SubprocessRunner:
    """Runs picklable calls in one spawned helper process with a wall-clock limit.

    A helper that runs past the limit is killed, and one that dies (a crash in C code, the
    OOM killer) is reaped: either way the call returns its default and the next call gets a
    fresh helper (pebble's pool replaces the worker).
    """

    def __init__(self) -> None:
        self._pool: ProcessPool | None = None
        self._lock = threading.Lock()

    def _live_pool(self) -> ProcessPool:
        with self._lock:
            if self._pool is None or not self._pool.active:
                ctx = multiprocessing.get_context("spawn")
                self._pool = ProcessPool(max_workers=1, context=ctx)
            return self._pool

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float, default: Any) -> Any:
        """``fn(*args)`` in the helper; ``default`` if it takes too long or the helper dies."""
        pool = self._live_pool()
        try:
            return pool.schedule(fn, args=args, timeout=timeout_s).result()
        except (FutureTimeout, ProcessExpired):
            return default
        except BrokenProcessPool:  # the pool itself is gone: the next call starts another
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.stop()
            return default

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()


_RUNNER = SubprocessRunner()


def verify_answer(label: str, answer: str, timeout_s: float = 5.0) -> bool:
    """Is ``answer`` mathematically equal to ``label``? False on parse failure or timeout.

    Identical strings short-circuit without sympy. In the main thread math-verify's own
    signal timeouts apply; elsewhere the check runs in a helper process (a first call there
    pays for starting it), killed after ``3 * timeout_s + 30`` seconds.
    """
    if _normal(answer) == _normal(label) and _normal(label):
        return True
    if threading.current_thread() is threading.main_thread():
        return verify_answer_unsafe(label, answer, timeout_s)
    return bool(
        _RUNNER.run(verify_answer_unsafe, (label, answer, timeout_s), 3 * timeout_s + 30, False)
    )


def math_reward(response: str, label: str, timeout_s: float = 5.0) -> tuple[bool, bool]:
    """(correct, well_formed): well-formed means a boxed or "answer is" answer was found."""
    answer, how = extract_math_answer(response)
    if answer is None:
        return False, False
    return verify_answer(label, answer, timeout_s), how in ("boxed", "answer_is")
