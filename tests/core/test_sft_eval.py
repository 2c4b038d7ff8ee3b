"""Prompt/answer rows (loss on the answer only) and the pretraining eval's exact match."""

from __future__ import annotations

import math

import pytest
import torch

from titan_core.data.arithmetic import generate_problems
from titan_core.data.sft import PromptResponseDataset, arithmetic_sft_dataset
from titan_core.data.tokenizer import ByteTokenizer
from titan_core.training.loop import exact_match_stats


def test_rows_mask_exactly_the_response():
    ds = PromptResponseDataset([([1, 2, 3], [4, 5]), ([6], [7, 8, 9])], seq_length=6, pad=0)
    assert len(ds) == 2
    row = ds[0]
    assert row["tokens"].tolist() == [1, 2, 3, 4, 5, 0]
    assert row["labels"].tolist() == [2, 3, 4, 5, 0, 0]
    # positions 2 and 3 predict the response tokens 4 and 5
    assert row["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0]
    assert row["position_ids"].tolist() == list(range(6))
    row = ds[1]
    assert [t for t, m in zip(row["labels"], row["loss_mask"], strict=True) if m] == [7, 8, 9]


def test_pair_longer_than_the_sequence_names_the_setting():
    with pytest.raises(ValueError, match="model.seq_length"):
        PromptResponseDataset([([1, 2, 3, 4], [5, 6, 7])], seq_length=4, pad=0)


def test_arithmetic_rows_carry_the_answer_newline_and_eod():
    tok = ByteTokenizer()
    ds = arithmetic_sft_dataset(50, 3, seed=7, fmt="plain", seq_length=16, tokenizer=tok)
    problems = list(generate_problems(50, 3, seed=7))
    for i in (0, 17, 49):
        row = ds[i]
        target = [int(t) for t, m in zip(row["labels"], row["loss_mask"], strict=True) if m]
        assert target == [*tok.tokenize(problems[i].answer + "\n"), tok.eod]
    held_out = arithmetic_sft_dataset(20, 3, 7, "plain", 16, tok, split="eval")
    train_prompts = {bytes(ds[i]["tokens"][:8].tolist()) for i in range(len(ds))}
    assert all(bytes(held_out[i]["tokens"][:8].tolist()) not in train_prompts for i in range(20))


def test_exact_match_counts_rows_right_at_every_masked_position():
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [0, 0, 0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 0, 0]], dtype=torch.float)
    predicted = torch.tensor([[0, 2, 3], [1, 2, 0], [3, 2, 3], [0, 0, 0]])
    logits = torch.nn.functional.one_hot(predicted, 4).float() * 10
    loss, correct, rows = exact_match_stats(logits, labels, mask)
    # row 0: wrong only outside the mask -> right; row 1: wrong answer token; row 2: right;
    # row 3: nothing to score
    assert (correct.item(), rows.item()) == (2, 3)
    p_right = math.exp(10) / (math.exp(10) + 3)
    per_token = [-math.log(p_right)] * 5 + [-math.log(1 / (math.exp(10) + 3))]
    assert loss.item() == pytest.approx(sum(per_token) / 6, rel=1e-5)
