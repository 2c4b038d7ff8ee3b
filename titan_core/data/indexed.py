"""Write Megatron's indexed dataset format (.bin/.idx) from token sequences."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch


def write_indexed_dataset(
    documents: Iterable[list[int]], output_prefix: str | Path, vocab_size: int, eod: int | None
) -> int:
    """Write documents (token id lists) to ``prefix.bin``/``prefix.idx``; return the count.

    Written under temporary names and renamed last, so a reader never sees half a dataset.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(prefix.name + f".tmp{os.getpid()}")
    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(str(tmp) + ".bin", dtype=dtype)
    count = 0
    for doc in documents:
        if eod is not None:
            doc = [*doc, eod]
        if not doc:
            continue
        builder.add_item(torch.from_numpy(np.asarray(doc, dtype=np.int64)))
        builder.end_document()
        count += 1
    builder.finalize(str(tmp) + ".idx")
    os.replace(str(tmp) + ".bin", str(prefix) + ".bin")
    os.replace(str(tmp) + ".idx", str(prefix) + ".idx")
    return count


def indexed_dataset_exists(prefix: str | Path) -> bool:
    return Path(str(prefix) + ".bin").is_file() and Path(str(prefix) + ".idx").is_file()
