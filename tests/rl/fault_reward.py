"""The easy reward (answers that start with 1), misbehaving on a schedule: each reward
worker process counts its calls and fails every 7th (NaN) and, in ``invalid_and_hang``,
every 5th too (1e39: finite in Python, inf in float32) and hangs on every 11th (a stuck
remote reward model). And rewards that misbehave on every call: a ``correct`` given as the
string "False", a hang."""

from __future__ import annotations

import math
import time

_calls = 0


def _easy(response: str) -> float:
    return 1.0 if response.strip().startswith("1") else 0.0


def nan_sometimes(prompt: str, response: str, label: str, metadata: dict) -> float:
    global _calls
    _calls += 1
    return math.nan if _calls % 7 == 0 else _easy(response)


def invalid_and_hang(prompt: str, response: str, label: str, metadata: dict) -> float:
    global _calls
    _calls += 1
    if _calls % 11 == 0:
        time.sleep(3600)
    if _calls % 5 == 0:
        return 1e39  # passed the check as a Python float, then stopped the trainer as inf
    return math.nan if _calls % 7 == 0 else _easy(response)


def false_as_string(prompt: str, response: str, label: str, metadata: dict) -> dict:
    """Half a score, and "wrong" as a string (bool("False") is True: counted right)."""
    return {"score": 0.5, "correct": "False"}


def always_hang(prompt: str, response: str, label: str, metadata: dict) -> float:
    """A remote reward model that never answers."""
    time.sleep(3600)
    return 0.0
