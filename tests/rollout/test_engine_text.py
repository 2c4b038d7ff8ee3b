"""A model directory with a tokenizer: ``text`` prompts, ``text`` in responses, stop strings
(the app in-process, over Starlette's test client)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from titan_rl.engine.core import Engine
from titan_rl.engine.server import create_app


def save_word_tokenizer(path: Path, vocab_size: int = 300) -> None:
    """A word-level tokenizer whose token i is the word ``w{i}`` (0-2 are special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def app_client(
    tmp_path_factory: pytest.TempPathFactory, make_model
) -> Iterator[tuple[TestClient, Engine]]:
    path = make_model(tmp_path_factory.mktemp("with-tokenizer"), "qwen2")
    save_word_tokenizer(path)
    engine = Engine(str(path), num_threads=1)
    assert engine.tokenizer is not None
    # transformers 5 picks the tokenizer class from the model type (Qwen2Tokenizer, BPE) over
    # tokenizer_config; this synthetic word-level tokenizer needs the generic fast class
    from transformers import PreTrainedTokenizerFast

    engine.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    with TestClient(create_app(engine)) as client:
        yield client, engine
    engine.shutdown()


GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_text_prompt_and_text_output(app_client: tuple[TestClient, Engine]) -> None:
    client, engine = app_client
    assert engine.tokenizer is not None
    by_text = client.post("/generate", json={"text": "w5 w6 w7", "sampling_params": GREEDY}).json()
    by_ids = client.post(
        "/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY}
    ).json()
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["text"] == " ".join(f"w{t}" for t in by_text["output_ids"] if t > 2)
    batch = client.post(
        "/generate", json={"text": ["w5 w6 w7", "w9"], "sampling_params": GREEDY}
    ).json()
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 1]


def test_stop_string_ends_and_is_trimmed(app_client: tuple[TestClient, Engine]) -> None:
    client, _ = app_client
    ids = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY}).json()[
        "output_ids"
    ]
    words = [f"w{t}" for t in ids]
    stop = words[3]
    first = next(i for i, w in enumerate(words) if stop in w)
    res = client.post(
        "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "stop": stop}}
    ).json()
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert res["output_ids"] == ids[: first + 1]
    assert stop not in res["text"]
