"""Reward functions loaded by import path in the tests."""

from __future__ import annotations

not_callable = 3


def length_bonus(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1 for a right first word, plus metadata['bonus'] per character of the prompt."""
    right = response.split()[0] == label if response.split() else False
    return float(right) + metadata.get("bonus", 0.0) * len(prompt)


def as_dict(prompt: str, response: str, label: str, metadata: dict) -> dict:
    ok = label in response
    return {"score": 2.0 if ok else -1.0, "correct": ok, "note": "dict"}


def no_score(prompt: str, response: str, label: str, metadata: dict) -> dict:
    return {"value": 1.0}


def bad_signature(response: str) -> float:
    return 0.0
