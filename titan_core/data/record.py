"""``<prefix>.titan.json``: what a dataset was tokenized with and its token id range.

Written by preprocessing next to ``<prefix>.bin/.idx`` (and cached there after a one-time
scan for datasets made elsewhere), so start-up can check a dataset against the model's
tokenizer without reading the ``.bin``. A record whose counts differ from the ``.idx`` is
stale (the dataset was rewritten) and is ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError


class TokenizerRecord(BaseModel):
    """Who made the token ids: a name for people, a vocabulary fingerprint for the check."""

    name: str
    vocab_size: int
    #: sha256 of the (id, token) pairs: see ``vocab_fingerprint`` in titan_core.data.tokenizer
    vocab_sha256: str


class DatasetRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    #: None for a dataset made by another tool (only its token ids were scanned)
    tokenizer: TokenizerRecord | None = None
    max_token_id: int
    #: None in records written before it was kept: the ``.bin`` is scanned again
    min_token_id: int | None = None
    num_sequences: int
    num_tokens: int


def tokenizer_record(tokenizer) -> TokenizerRecord:  # noqa: ANN001 - a titan_core tokenizer
    return TokenizerRecord(
        name=str(tokenizer.unique_description),
        vocab_size=int(tokenizer.vocab_size),
        vocab_sha256=tokenizer.vocab_fingerprint(),
    )


def record_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.titan.json")


def write_record(path: Path, record: DatasetRecord) -> None:
    """Write atomically (a reader never sees half a record)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(record.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_record(prefix: str | Path, num_sequences: int, num_tokens: int) -> DatasetRecord | None:
    """The dataset's record, or None when there is none, it is unreadable, or it describes
    another dataset than the ``.idx`` (``num_sequences``/``num_tokens``) now at ``prefix``."""
    try:
        record = DatasetRecord.model_validate_json(record_path(prefix).read_bytes())
    except (OSError, ValidationError):
        return None
    if (record.num_sequences, record.num_tokens) != (num_sequences, num_tokens):
        return None
    if record.min_token_id is None:  # an older record: the range is scanned and kept
        return None
    return record
