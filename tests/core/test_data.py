"""Data: the arithmetic task, tokenizers, and JSONL -> Megatron .bin/.idx preprocessing."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from titan_core.data.arithmetic import generate_problems
from titan_core.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer


def test_arithmetic_is_reproducible_and_splits_are_disjoint():
    a = list(generate_problems(500, 3, seed=7))
    b = list(generate_problems(500, 3, seed=7))
    assert a == b
    assert all(p.text == f"{p.a}+{p.b}={p.a + p.b}" for p in a)
    held_out = {(p.a, p.b) for p in generate_problems(200, 3, seed=7, split="eval")}
    assert len(held_out) > 150
    assert held_out.isdisjoint({(p.a, p.b) for p in generate_problems(5000, 3, seed=1)})


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.tokenize("12+30=42\n")
    assert max(ids) < 256 and tok.detokenize([*ids, tok.eod]) == "12+30=42\n"
    assert tok.vocab_size == 258


def _tiny_hf_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {
        "<|endoftext|>": 0,
        "<pad>": 1,
        **{c: i + 2 for i, c in enumerate("0123456789+=\n ab")},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(path))
    return path


def test_preprocess_jsonl_to_indexed_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    rows = [{"text": "12+3=15"}, {"other": 1}, {"text": "1+1=2"}, {"text": 5}]
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok_file = _tiny_hf_tokenizer(tmp_path / "tokenizer.json")
    proc = subprocess.run(
        [sys.executable, "-m", "titan_core.data.preprocess", "--input", str(src),
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "hf",
         "--tokenizer-model", str(tok_file)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "wrote 2 documents" in proc.stdout and "skipped 2 rows" in proc.stdout
    ds = IndexedDataset(str(tmp_path / "out"))
    tok = HFTokenizer(str(tok_file))
    assert len(ds) == 2
    assert tok.detokenize(ds[0][:-1]).replace(" ", "") == "12+3=15"
    assert ds[0][-1] == tok.eod == 0 and tok.pad == 1
    assert np.array_equal(ds[1][:-1], tok.tokenize("1+1=2"))


def test_preprocess_rejects_broken_json(tmp_path, capsys):
    """The command's ``main`` in this process (its exit status; the process itself:
    test_preprocess_jsonl_to_indexed_dataset)."""
    from titan_core.data import preprocess

    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{broken\n')
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "o")])
    assert rc == 2 and "bad.jsonl:2: not valid JSON" in capsys.readouterr().err


def test_unknown_tokenizer_type():
    with pytest.raises(ValueError, match="byte or hf"):
        build_tokenizer("sentencepiece")
