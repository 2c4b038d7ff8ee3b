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


def _byte_symbols() -> list[str]:
    """The printable character that stands for each byte in a byte-level BPE vocabulary
    (the GPT-2 convention ``tokenizers``' ByteLevel pre-tokenizer maps bytes with):
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


#: what transformers reads besides tokenizer.json, copied beside exported weights
HF_TOKENIZER_FILES = (
    "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "chat_template.jinja", "added_tokens.json",
)  # fmt: skip


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

    def save_hf(self, directory: str | Path) -> None:
        """This tokenizer as HF files (tokenizer.json, tokenizer_config.json) beside exported
        weights, so transformers' AutoTokenizer and SGLang load it: a byte-level BPE with
        no merges gives every byte its own id (the byte's value) and decodes as
        :meth:`detokenize` does."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken("<eod>", special=True), AddedToken("<pad>", special=True)]
        )
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eod>", pad_token="<pad>")
        hf.save_pretrained(str(directory))

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
        self.file = file
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

    def save_hf(self, directory: str | Path) -> None:
        """tokenizer.json and the HF tokenizer files beside it, copied to ``directory``;
        without a tokenizer_config.json there, one naming the fast tokenizer and its end of
        text, so AutoTokenizer loads it whatever model type the weights declare."""
        import json
        import shutil

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if out.resolve() == self.file.parent.resolve():
            return
        shutil.copyfile(self.file, out / "tokenizer.json")
        for name in HF_TOKENIZER_FILES:
            if (self.file.parent / name).is_file():
                shutil.copyfile(self.file.parent / name, out / name)
        if not (out / "tokenizer_config.json").is_file():
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": self._tok.id_to_token(self.eod),
            }
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

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
