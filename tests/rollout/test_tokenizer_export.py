"""The run's tokenizer written beside exported weights (what the GRPO job does to
``<run.dir>/hf_start``): transformers' AutoTokenizer reads the same ids and text as Titan's
own tokenizer, and the built-in engine serving the directory matches stop texts with it."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import httpx
import pytest

from titan_core.data.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = ["123+456=CALC(123+456)=579 579\n", "Grüße, 世界! \t tabs  and  spaces\n\n", " x"]


def _auto(path: Path):  # noqa: ANN202
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_byte_tokenizer_exported_reads_the_same_ids_and_text(tmp_path: Path) -> None:
    ours = ByteTokenizer()
    ours.save_hf(tmp_path)
    theirs = _auto(tmp_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids
        assert theirs.decode(ids) == ours.decode(ids) == text
    # every byte, in any order (broken UTF-8 included), decodes as Titan's tokenizer does
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        assert theirs.decode(ids) == ours.decode(ids)
    assert theirs.eos_token_id == ours.eod and theirs.pad_token_id == ours.pad
    assert len(theirs) == ours.vocab_size


def test_hf_tokenizer_file_alone_is_exported_loadable(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<pad>": 1, **{c: i + 2 for i, c in enumerate("0123456789+= ")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = HFTokenizer(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "exported"
    ours.save_hf(out)
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    theirs = _auto(out)
    assert theirs.encode("12+30= 42", add_special_tokens=False) == ours.encode("12+30= 42")
    ours.save_hf(out)  # again, over its own files: unchanged
    assert HFTokenizer(str(out)).encode("7+7") == ours.encode("7+7")


@pytest.mark.slow
def test_engine_with_the_exported_byte_tokenizer_stops_at_a_stop_text(
    tmp_path: Path, tiny_model: Path, engine_factory
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)  # vocabulary 300: the bytes, <eod>, <pad> and more
    ByteTokenizer().save_hf(model)
    server = engine_factory(model, "byte-tokenizer")
    params = {"max_new_tokens": 64, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    body = {"input_ids": [49, 50, 43], "sampling_params": params}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/get_server_info").json()["skip_tokenizer_init"] is False
        free = http.post("/generate", json=body).json()
        printable = [i for i, t in enumerate(free["output_ids"]) if 33 <= t <= 126]
        assert printable, free["output_ids"]  # 64 draws, nearly uniform over 300 ids
        stop = chr(free["output_ids"][printable[len(printable) // 2]])
        first = next(i for i, t in enumerate(free["output_ids"]) if t == ord(stop))
        body["sampling_params"] = {**params, "stop": stop, "no_stop_trim": True}
        cut = http.post("/generate", json=body).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["output_ids"] == free["output_ids"][: first + 1]
    assert cut["text"].endswith(stop)
