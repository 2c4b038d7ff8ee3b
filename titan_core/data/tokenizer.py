"""Tokenizers: a built-in byte-level one (no download) and HF ``tokenizers`` files.

Both expose what megatron-core's datasets read (``vocab_size``, ``eod``, ``pad``,
``tokenize``, ``detokenize``, ``unique_identifiers``) and what the RL side needs
(``bos``, ``encode``/``decode``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def vocab_sha256(tokens: Iterable[tuple[int, str]]) -> str:
    """A fingerprint of (id, token) pairs in id order: equal for two tokenizers whose ids
    mean the same tokens."""
    h = hashlib.sha256()
    for i, token in sorted(tokens):
        h.update(f"{i}\t{token}\n".encode())
    return h.hexdigest()


class ByteTokenizer:
    """UTF-8 bytes 0..255, then ``<eod>`` = 256 and ``<pad>`` = 257."""

    def __init__(self) -> None:
        self.unique_identifiers = OrderedDict(cls="ByteTokenizer")
        self.unique_description = "ByteTokenizer"

    vocab_size = 258
    eod = 256
    pad = 257
    bos = None
    eos = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode = tokenize

    def detokenize(self, ids) -> str:  # noqa: ANN001 - list or array
        data = bytes(int(i) for i in np.asarray(ids).tolist() if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    decode = detokenize

    def vocab_fingerprint(self, num_ids: int | None = None) -> str:
        """sha256 of the tokens with ids below ``num_ids`` (all by default)."""
        names = [f"<0x{b:02X}>" for b in range(256)] + ["<eod>", "<pad>"]
        n = self.vocab_size if num_ids is None else num_ids
        return vocab_sha256(enumerate(names[:n]))


class HFTokenizer:
    """A ``tokenizers`` tokenizer from a tokenizer.json file or an HF model directory."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(
                f"no tokenizer at {path}: give a tokenizer.json file or a directory holding one"
            )
        self._tok = Tokenizer.from_file(str(file))
        self.unique_identifiers = OrderedDict(cls="HFTokenizer", path=str(file))
        self.unique_description = f"HFTokenizer({file})"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eod = next(
            (
                vocab[t]
                for t in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
                if t in vocab
            ),
            None,
        )
        if eod is None:
            raise ValueError(f"tokenizer {file} has no end-of-text token (<|endoftext|>, </s>)")
        self.eod = self.eos = eod
        self.pad = next((vocab[t] for t in ("<pad>", "<|pad|>", "[PAD]") if t in vocab), eod)
        self.bos = next((vocab[t] for t in ("<s>", "<|begin_of_text|>") if t in vocab), None)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    encode = tokenize

    def detokenize(self, ids) -> str:  # noqa: ANN001
        return self._tok.decode([int(i) for i in np.asarray(ids).tolist()])

    decode = detokenize

    def vocab_fingerprint(self, num_ids: int | None = None) -> str:
        """sha256 of the tokens with ids below ``num_ids`` (all by default)."""
        n = self.vocab_size if num_ids is None else num_ids
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return vocab_sha256((i, t) for t, i in vocab.items() if i < n)


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None):  # noqa: ANN201
    """The tokenizer a ``data`` config section names."""
    if tokenizer_type == "byte":
        return ByteTokenizer()
    if tokenizer_type == "hf":
        if not tokenizer_model:
            raise ValueError("data.tokenizer_model is required for data.tokenizer_type=hf")
        return HFTokenizer(tokenizer_model)
    raise ValueError(f"unknown data.tokenizer_type {tokenizer_type!r}; use byte or hf")
