"""The easy reward (answers that start with 1), misbehaving on a schedule: each reward
worker process counts its calls and fails every 7th (NaN) and, in ``nan_and_hang``, hangs
on every 11th (a stuck remote reward model)."""

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


def nan_and_hang(prompt: str, response: str, label: str, metadata: dict) -> float:
    global _calls
    _calls += 1
    if _calls % 11 == 0:
        time.sleep(3600)
    return math.nan if _calls % 7 == 0 else _easy(response)
