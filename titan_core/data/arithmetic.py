"""A generated arithmetic task: learnable, needs no download, shared by pretraining and RL.

Problems are ``a+b=`` with ``num_digits``-digit operands; the answer is the decimal sum.
Two formats: ``plain`` (``57+8=65``) and ``aligned`` (operands zero-padded to the same
width, the sum written least-significant digit first: ``57+08=560``). Small transformers
learn the aligned one far faster: each answer digit depends only on digits already seen.
A fixed seed and an index define every problem, so the pretraining corpus, the RL prompts
and the held-out eval set are reproducible and disjoint (eval problems are those whose
hash falls in the held-out bucket).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

FORMATS = ("plain", "aligned")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    num_digits: int = 3
    fmt: str = "plain"

    @property
    def prompt(self) -> str:
        if self.fmt == "aligned":
            w = self.num_digits
            return f"{self.a:0{w}d}+{self.b:0{w}d}="
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        if self.fmt == "aligned":
            return f"{self.a + self.b:0{self.num_digits + 1}d}"[::-1]
        return str(self.a + self.b)

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def _held_out(a: int, b: int, eval_fraction: float) -> bool:
    digest = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") / 2**32 < eval_fraction


def generate_problems(
    num: int,
    num_digits: int = 3,
    seed: int = 0,
    split: str = "train",
    eval_fraction: float = 0.05,
    fmt: str = "plain",
) -> Iterator[Problem]:
    """``num`` problems of the given split ("train" or "eval"), reproducible from ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {fmt!r}")
    rng = np.random.default_rng(seed)
    hi = 10**num_digits
    want_eval = split == "eval"
    produced = 0
    while produced < num:
        pairs = rng.integers(0, hi, size=(max(1024, num), 2))
        for a, b in pairs.tolist():
            if _held_out(a, b, eval_fraction) == want_eval:
                yield Problem(a, b, num_digits, fmt)
                produced += 1
                if produced == num:
                    return
