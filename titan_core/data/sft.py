"""Prompt/response rows for supervised fine-tuning: the loss counts response tokens only.

One pair per row, right-padded to ``seq_length``: the sample layout megatron's forward step
reads (``tokens``, ``labels``, ``loss_mask``, ``position_ids``). Masking the prompt matters
for the arithmetic task: its operands are random digits, and their unlearnable loss
(ln 10 per digit) otherwise drowns the answer's signal. A 0.9M-parameter GPT reaches tens
of percent on 3-digit addition in a few CPU minutes this way, and stays near zero when
trained on the packed corpus with the loss on every token.

With ``data.tool_fraction`` a share of the rows is written as calculator transcripts
(titan_core/data/calc_transcript.py): the model's call, the calculator's reply and the
model's final answer, the reply with no loss (the environment writes it, never the model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from titan_core.data.calc_transcript import tool_transcript

if TYPE_CHECKING:
    from titan_core.data.arithmetic import Problem

#: a row: prompt ids, response ids and, optionally, the response's per-token loss mask
#: (None: every response token is trained)
Row = (
    tuple[Sequence[int], Sequence[int]] | tuple[Sequence[int], Sequence[int], Sequence[int] | None]
)


class PromptResponseDataset:
    """Map-style dataset of ``(prompt_ids, response_ids[, response_mask])`` rows, one per
    row; the loss counts the response tokens whose mask is 1 (all of them without a mask)."""

    def __init__(self, pairs: Iterable[Row], seq_length: int, pad: int) -> None:
        rows = [_row(*pair) for pair in pairs]
        if not rows:
            raise ValueError("no prompt/response pairs")
        longest = max(len(p) + len(r) for p, r, _ in rows)
        if longest > seq_length + 1:
            raise ValueError(
                f"a prompt/response pair has {longest} tokens, more than model.seq_length + 1 "
                f"= {seq_length + 1}; raise model.seq_length"
            )
        n = len(rows)
        self.tokens = np.full((n, seq_length + 1), pad, dtype=np.int64)
        self.loss_mask = np.zeros((n, seq_length), dtype=np.float32)
        for i, (p, r, m) in enumerate(rows):
            self.tokens[i, : len(p) + len(r)] = p + r
            # position j predicts token j + 1: response tokens are predicted from len(p) - 1 on
            self.loss_mask[i, len(p) - 1 : len(p) + len(r) - 1] = m
        self.position_ids = np.arange(seq_length, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        row = self.tokens[idx]
        return {
            "tokens": row[:-1],
            "labels": row[1:],
            "loss_mask": self.loss_mask[idx],
            "position_ids": self.position_ids,
        }


def _row(
    prompt: Sequence[int], response: Sequence[int], mask: Sequence[int] | None = None
) -> tuple[list[int], list[int], list[float]]:
    mask = [1.0] * len(response) if mask is None else [float(m) for m in mask]
    if len(mask) != len(response):
        raise ValueError(f"a response of {len(response)} tokens has {len(mask)} mask values")
    return list(prompt), list(response), mask


def _tool_response(problem: Problem, tokenizer) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """A calculator transcript's ids and loss mask (0 on the calculator's reply)."""
    ids: list[int] = []
    mask: list[int] = []
    for seg in tool_transcript(f"{problem.a}+{problem.b}", problem.answer):
        part = tokenizer.tokenize(seg.text)
        ids += part
        mask += [int(seg.model_written)] * len(part)
    return [*ids, tokenizer.eod], [*mask, 1]


def _tool_rows(num: int, seed: int, split: str, tool_fraction: float) -> np.ndarray:
    """Which of ``num`` rows are calculator transcripts: a draw of its own, so the problems
    are those of ``tool_fraction=0`` (the same seed) whatever the share."""
    stream = {"train": 0, "eval": 1}[split]
    rng = np.random.default_rng([seed, 0x7001, stream])
    return rng.random(num) < tool_fraction


def arithmetic_sft_dataset(
    num: int,
    num_digits: int,
    seed: int,
    fmt: str,
    seq_length: int,
    tokenizer,  # noqa: ANN001
    split: str = "train",
    tool_fraction: float = 0.0,
) -> PromptResponseDataset:
    """``num`` problems of ``split``: prompt ``a+b=``, response ``answer\\n<eod>``; with
    ``tool_fraction`` > 0 that share of rows (a seeded draw) answers with a calculator
    transcript instead: ``CALC(a+b)=answer answer\\n<eod>``, the loss off on ``=answer``."""
    from titan_core.data.arithmetic import generate_problems

    if tool_fraction > 0 and fmt != "plain":
        raise ValueError(
            f"data.tool_fraction needs data.arithmetic_format=plain (got {fmt!r}): the "
            "calculator answers the plain sum"
        )
    problems = generate_problems(num, num_digits, seed=seed, split=split, fmt=fmt)
    tool = _tool_rows(num, seed, split, tool_fraction) if tool_fraction > 0 else None

    def rows() -> Iterable[Row]:
        for i, p in enumerate(problems):
            prompt = tokenizer.tokenize(p.prompt)
            if tool is not None and tool[i]:
                yield (prompt, *_tool_response(p, tokenizer))
            else:
                yield prompt, [*tokenizer.tokenize(p.answer + "\n"), tokenizer.eod]

    return PromptResponseDataset(rows(), seq_length, tokenizer.pad)
