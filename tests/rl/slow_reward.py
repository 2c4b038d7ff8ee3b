"""The easy reward (answers that start with 1), slow: a rollout takes long enough that a
signal sent as a step ends lands in the next step's rollout."""

from __future__ import annotations

import time


def starts_with_one_slowly(prompt: str, response: str, label: str, metadata: dict) -> float:
    time.sleep(0.05)
    return 1.0 if response.strip().startswith("1") else 0.0
