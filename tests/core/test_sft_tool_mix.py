"""data.tool_fraction: arithmetic_sft rows written as calculator transcripts, the
calculator's reply out of the loss, and tool_fraction=0 as before."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from titan_core.config.pretrain import DataConfig
from titan_core.data.arithmetic import generate_problems
from titan_core.data.calc_transcript import tool_transcript
from titan_core.data.sft import arithmetic_sft_dataset
from titan_core.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
SEQ = 40


def _text(ids: np.ndarray) -> str:
    return TOK.decode([int(t) for t in ids if t not in (TOK.pad, TOK.eod)])


def _trained(row: dict[str, np.ndarray]) -> list[int]:
    return [int(t) for t, m in zip(row["labels"], row["loss_mask"], strict=True) if m]


def test_tool_rows_are_transcripts_with_the_reply_out_of_the_loss() -> None:
    num, seed = 400, 11
    ds = arithmetic_sft_dataset(num, 3, seed, "plain", SEQ, TOK, tool_fraction=0.3)
    problems = list(generate_problems(num, 3, seed=seed))
    tool_rows = 0
    for i, p in enumerate(problems):
        row = ds[i]
        text = _text(row["tokens"])
        assert text.startswith(p.prompt)
        if "CALC(" not in text:
            assert text == f"{p.prompt}{p.answer}\n"
            assert _trained(row) == [*TOK.tokenize(p.answer + "\n"), TOK.eod]
            continue
        tool_rows += 1
        s = p.a + p.b
        assert text == f"{p.a}+{p.b}=CALC({p.a}+{p.b})={s} {s}\n"
        # trained: the call, then the separator, the answer, the newline and eod; not "=s"
        call, reply = f"CALC({p.a}+{p.b})", f"={s}"
        assert _trained(row) == [*TOK.tokenize(call), *TOK.tokenize(f" {s}\n"), TOK.eod]
        # the reply's tokens are the labels of exactly the masked-off positions after the call
        start = len(p.prompt) - 1 + len(call)
        assert row["loss_mask"][start : start + len(reply)].tolist() == [0.0] * len(reply)
        assert TOK.decode(row["labels"][start : start + len(reply)].tolist()) == reply
    assert 0.2 < tool_rows / num < 0.4


def test_the_share_follows_tool_fraction_and_the_problems_do_not_move() -> None:
    plain = arithmetic_sft_dataset(300, 3, 5, "plain", SEQ, TOK)
    shares = []
    for f in (0.1, 0.5, 1.0):
        ds = arithmetic_sft_dataset(300, 3, 5, "plain", SEQ, TOK, tool_fraction=f)
        calls = ["CALC(" in _text(ds[i]["tokens"]) for i in range(300)]
        shares.append(sum(calls) / 300)
        # same problems in the same order, whatever the share
        assert all(
            _text(ds[i]["tokens"]).split("=")[0] == _text(plain[i]["tokens"]).split("=")[0]
            for i in range(300)
        )
    assert shares[0] < shares[1] < shares[2] == 1.0
    assert abs(shares[1] - 0.5) < 0.1


def test_tool_fraction_zero_is_bit_identical_to_direct_answers() -> None:
    base = arithmetic_sft_dataset(64, 3, 3, "plain", 16, TOK)
    zero = arithmetic_sft_dataset(64, 3, 3, "plain", 16, TOK, tool_fraction=0.0)
    assert np.array_equal(base.tokens, zero.tokens)
    assert np.array_equal(base.loss_mask, zero.loss_mask)
    for i in (0, 31, 63):
        row = base[i]
        assert _trained(row)[-1] == TOK.eod and "CALC" not in _text(row["tokens"])


def test_eval_rows_mix_too_and_stay_held_out() -> None:
    train = arithmetic_sft_dataset(200, 3, 9, "plain", SEQ, TOK, tool_fraction=0.5)
    held = arithmetic_sft_dataset(100, 3, 9, "plain", SEQ, TOK, split="eval", tool_fraction=0.5)
    prompts = {_text(train[i]["tokens"]).split("=")[0] for i in range(200)}
    held_texts = [_text(held[i]["tokens"]) for i in range(100)]
    assert 0 < sum("CALC(" in t for t in held_texts) < 100
    assert not {t.split("=")[0] for t in held_texts} & prompts


def test_a_transcript_too_long_for_the_sequence_names_the_setting() -> None:
    with pytest.raises(ValueError, match="model.seq_length"):
        arithmetic_sft_dataset(10, 3, 1, "plain", 16, TOK, tool_fraction=1.0)


def test_the_segments_say_who_writes_what() -> None:
    segs = tool_transcript("12+30", "42")
    assert [(s.text, s.model_written) for s in segs] == [
        ("CALC(12+30)", True),
        ("=42", False),
        (" 42\n", True),
    ]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"type": "arithmetic_sft", "tool_fraction": 1.5}, "tool_fraction"),
        ({"type": "arithmetic_sft", "tool_fraction": -0.1}, "tool_fraction"),
        ({"type": "arithmetic", "tool_fraction": 0.2}, "data.type=arithmetic_sft"),
        (
            {"type": "arithmetic_sft", "arithmetic_format": "aligned", "tool_fraction": 0.2},
            "data.arithmetic_format=plain",
        ),
    ],
)
def test_bad_tool_fraction_settings_name_the_key(data: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        DataConfig(**data)


def test_the_dataset_refuses_what_the_config_refuses() -> None:
    with pytest.raises(ValueError, match="data.arithmetic_format=plain"):
        arithmetic_sft_dataset(10, 3, 1, "aligned", SEQ, TOK, tool_fraction=0.2)
