"""Prompt sources for RL: the generated arithmetic task, or JSONL / Parquet files.

File rows missing ``data.prompt_key`` or ``data.label_key`` are skipped and counted (the
count is shown), never a crash deep in a rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import orjson

from titan_core.data.arithmetic import generate_problems
from titan_rl.config import RLDataConfig


class DatasetError(ValueError):
    """The dataset file cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class Prompt:
    text: str
    label: str
    metadata: dict[str, Any]


@dataclass
class PromptSet:
    prompts: list[Prompt]
    skipped: int = 0
    source: str = ""
    #: texts that end a response besides the tokenizer's end of text (the arithmetic task's
    #: answer ends at its newline; a file dataset's responses end at end of text only)
    stop: tuple[str, ...] = ()


class _Tokenizer(Protocol):
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def stop_token_ids(tokenizer: _Tokenizer, stop: Sequence[str], task: str = "the task") -> list[int]:
    """The tokenizer's end of text, then the token of each ``stop`` text (a rollout's
    ``stop_token_ids``); a text without a token of its own (split in several, or unknown) is
    a DatasetError naming ``task``."""
    ids = [tokenizer.eod]
    for text in stop:
        encoded = tokenizer.encode(text)
        if len(encoded) != 1 or tokenizer.decode(encoded) != text:
            raise DatasetError(
                f"{task} ends each response at {text!r}, which the tokenizer has no token of "
                f"its own for (it encodes it as {encoded}); use a tokenizer with one "
                "(data.tokenizer_model) or data.tokenizer_type=byte"
            )
        if encoded[0] not in ids:
            ids.append(encoded[0])
    return ids


def _read_rows(path: str, kind: str, key: str) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{key} {path} is not a file; check the path")
    if kind == "parquet":
        import polars as pl

        try:
            return pl.read_parquet(p).to_dicts()
        except (pl.exceptions.PolarsError, OSError) as e:
            raise DatasetError(
                f"{key} {path} is not a readable Parquet file ({type(e).__name__}: {e}); "
                "check data.type"
            ) from None
    rows = []
    for lineno, line in enumerate(p.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise DatasetError(
                f"{key} {path}:{lineno}: not valid JSON ({e}); one JSON object per line"
            ) from None
        rows.append(row if isinstance(row, dict) else {})
    return rows


def _prompt_text(value: Any, cfg: RLDataConfig, chat_template: Any) -> str | None:
    if isinstance(value, list):  # chat messages
        if chat_template is None:
            return None
        return chat_template(value)
    if not isinstance(value, str):
        return None
    if chat_template is not None:
        return chat_template([{"role": "user", "content": value}])
    return value


def _chat_template(cfg: RLDataConfig) -> Any:
    if not cfg.apply_chat_template:
        return None
    if cfg.tokenizer_type != "hf":
        raise DatasetError("data.apply_chat_template needs data.tokenizer_type=hf (a chat model)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer_model)
    return lambda msgs: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def load_file_prompts(path: str, cfg: RLDataConfig, key: str = "data.path") -> PromptSet:
    """The usable rows of the file ``path`` (named ``key`` in errors); the others counted."""
    rows = _read_rows(path, cfg.type, key)
    template = _chat_template(cfg)
    out, skipped = [], 0
    for row in rows:
        text = _prompt_text(row.get(cfg.prompt_key), cfg, template)
        label = row.get(cfg.label_key)
        if text is None or label is None:
            skipped += 1
            continue
        meta = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.label_key)}
        out.append(Prompt(text, str(label), meta))
    if not out:
        raise DatasetError(
            f"{key} {path}: no row has both {cfg.prompt_key!r} and {cfg.label_key!r}; set "
            "data.prompt_key / data.label_key to your columns"
        )
    return PromptSet(out, skipped, path)


def load_prompts(cfg: RLDataConfig, seed: int, split: str, num: int | None = None) -> PromptSet:
    """Training (``split="train"``) or held-out (``"eval"``) prompts."""
    if cfg.type == "arithmetic":
        count = num or (100_000 if split == "train" else cfg.num_eval)
        probs = generate_problems(
            count, cfg.num_digits, seed=seed, split=split, fmt=cfg.arithmetic_format
        )
        prompts = [Prompt(p.prompt, p.answer, {}) for p in probs]
        return PromptSet(prompts, 0, "arithmetic", stop=("\n",))
    key = "data.eval_path" if split == "eval" and cfg.eval_path else "data.path"
    path = cfg.eval_path if key == "data.eval_path" else cfg.path
    ps = load_file_prompts(path, cfg, key)
    return _held_out(ps, cfg) if split == "eval" else ps


def _held_out(ps: PromptSet, cfg: RLDataConfig) -> PromptSet:
    """A file's held-out prompts: its first ``data.num_eval`` rows."""
    return replace(ps, prompts=ps.prompts[: cfg.num_eval])


def load_splits(cfg: RLDataConfig, seed: int) -> tuple[PromptSet, PromptSet]:
    """The training and the held-out prompts (``load_prompts``' two splits), reading and
    templating ``data.path`` once where the held-out prompts are its first rows."""
    train = load_prompts(cfg, seed, "train")
    if cfg.type == "arithmetic" or cfg.eval_path:
        return train, load_prompts(cfg, seed, "eval")
    return train, _held_out(train, cfg)


class PromptSampler:
    """Epoch-wise shuffled prompts from a seed (in file order with ``shuffle=False``); the
    position is saved for exact resume."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True) -> None:
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._perm()

    def _perm(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng(self.seed + self.epoch).permutation(len(self.prompts))

    def take(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._perm()
            out.append(self.prompts[int(self._order[self.offset])])
            self.offset += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._perm()
