"""Megatron's indexed dataset format (.bin/.idx): write it from token sequences, read the
``.idx`` summary that start-up checks need, and scan a ``.bin`` for its largest token id.

The ``.idx`` layout (megatron/core/datasets/indexed_dataset.py, ``_IndexWriter``): a 9-byte
magic, u64 version (1), u8 dtype code, u64 sequence count, u64 document count, then int32
sequence lengths, int64 sequence pointers (byte offsets into the ``.bin``) and int64
document indices. The ``.bin`` is the sequences back to back, so its size is the total
sequence length times the dtype size.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from titan_core.data.record import DatasetRecord, record_path, tokenizer_record, write_record

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents


class IndexedDataError(ValueError):
    """A damaged or empty ``.bin``/``.idx`` pair; the message names the file."""


class EmptyDatasetError(IndexedDataError):
    """Nothing to write: every input document was skipped or empty."""


@dataclass(frozen=True)
class IndexSummary:
    """What the ``.idx`` of ``prefix`` says, read without touching the ``.bin``."""

    prefix: str
    dtype: np.dtype
    #: tokens per sequence (one sequence per document for Titan's preprocessing); memory-mapped
    sequence_lengths: np.ndarray

    @property
    def bin_path(self) -> Path:
        return Path(f"{self.prefix}.bin")

    @property
    def idx_path(self) -> Path:
        return Path(f"{self.prefix}.idx")

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @cached_property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def bin_bytes(self) -> int:
        """The size the ``.bin`` must have."""
        return self.num_tokens * self.dtype.itemsize


def read_index(prefix: str | Path) -> IndexSummary:
    """Read ``prefix.idx``; raise :class:`IndexedDataError` naming it when it is damaged."""
    from megatron.core.datasets.indexed_dataset import DType

    idx = Path(f"{prefix}.idx")
    size = idx.stat().st_size
    redo = "make it again with python -m titan_core.data.preprocess"
    if size < _HEADER.size:
        raise IndexedDataError(
            f"{idx} is damaged: {size} bytes, shorter than the {_HEADER.size}-byte header; {redo}"
        )
    with open(idx, "rb") as f:
        magic, version, code, sequences, documents = _HEADER.unpack(f.read(_HEADER.size))
    if magic != _MAGIC or version != 1:
        raise IndexedDataError(f"{idx} is not a Megatron indexed dataset index (.idx); {redo}")
    try:
        dtype = np.dtype(DType.dtype_from_code(code))
    except ValueError:
        raise IndexedDataError(
            f"{idx} is damaged: unknown token dtype code {code}; {redo}"
        ) from None
    needed = _HEADER.size + sequences * (4 + 8) + documents * 8
    if size < needed:
        raise IndexedDataError(
            f"{idx} is damaged (truncated?): {size} bytes, but its header needs {needed}; {redo}"
        )
    lengths = (
        np.memmap(idx, dtype=np.int32, mode="r", offset=_HEADER.size, shape=(sequences,))
        if sequences
        else np.zeros(0, dtype=np.int32)
    )
    return IndexSummary(str(prefix), dtype, lengths)


def scan_token_id_range(summary: IndexSummary, chunk_tokens: int = 1 << 26) -> tuple[int, int]:
    """The smallest and largest token ids in the ``.bin`` ((0, -1) when empty), read in
    chunks."""
    if summary.num_tokens == 0:
        return 0, -1
    data = np.memmap(summary.bin_path, dtype=summary.dtype, mode="r", shape=(summary.num_tokens,))
    lo, hi = None, None
    for i in range(0, summary.num_tokens, chunk_tokens):
        chunk = data[i : i + chunk_tokens]
        c_lo, c_hi = int(chunk.min()), int(chunk.max())
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
    return lo, hi


def write_indexed_dataset(
    documents: Iterable[list[int]],
    output_prefix: str | Path,
    tokenizer,  # noqa: ANN001 - a titan_core tokenizer
    append_eod: bool = True,
) -> DatasetRecord:
    """Write documents (token id lists) to ``prefix.bin``/``.idx`` and ``prefix.titan.json``.

    Written under temporary names and renamed last, so a reader never sees half a dataset;
    the temporary files are removed when writing fails. Raises :class:`EmptyDatasetError`
    (writing nothing) when no document has a token.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(prefix.name + f".tmp{os.getpid()}")
    tmp_files = [Path(f"{tmp}{ext}") for ext in (".bin", ".idx", ".titan.json")]
    builder = IndexedDatasetBuilder(
        str(tmp_files[0]), dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    try:
        count = tokens = 0
        max_id, min_id = -1, 0
        for doc in documents:
            if append_eod:
                doc = [*doc, tokenizer.eod]
            if not doc:
                continue
            ids = np.asarray(doc, dtype=np.int64)
            builder.add_item(torch.from_numpy(ids))
            builder.end_document()
            count += 1
            tokens += ids.size
            max_id = max(max_id, int(ids.max()))
            min_id = min(min_id, int(ids.min()))
        builder.finalize(str(tmp_files[1]))
        if count == 0:
            raise EmptyDatasetError(f"no documents to write to {prefix}.bin/.idx")
        record = DatasetRecord(
            tokenizer=tokenizer_record(tokenizer),
            max_token_id=max_id,
            min_token_id=min_id,
            num_sequences=count,
            num_tokens=tokens,
        )
        write_record(tmp_files[2], record)
        os.replace(tmp_files[2], record_path(prefix))
        os.replace(tmp_files[0], f"{prefix}.bin")
        os.replace(tmp_files[1], f"{prefix}.idx")
    finally:
        builder.data_file.close()
        for f in tmp_files:
            f.unlink(missing_ok=True)
    return record


def indexed_dataset_exists(prefix: str | Path) -> bool:
    return Path(str(prefix) + ".bin").is_file() and Path(str(prefix) + ".idx").is_file()
