"""Start-up checks of the training data, run before any process group or model is built.

Each failure is a :class:`ConfigError` naming the file and the key to change:

* every ``data.data_path`` prefix has a readable ``.idx``, a ``.bin`` of exactly the size the
  ``.idx`` describes, and at least one document;
* ``data.split`` gives every split the run uses (train; validation when ``train.eval_interval``
  is set) at least one document of each dataset (megatron-core loops forever on an empty one);
* the token ids were made by the model's tokenizer: the dataset's record
  (``<prefix>.titan.json``, see :mod:`titan_core.data.record`) names its tokenizer; a dataset
  without one has its largest token id scanned once (on rank 0) and cached there.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from titan_core.config import ConfigError
from titan_core.config.pretrain import PretrainConfig
from titan_core.data.indexed import IndexedDataError, IndexSummary, read_index, scan_token_id_range
from titan_core.data.record import (
    DatasetRecord,
    read_record,
    record_path,
    write_record,
)
from titan_core.data.tokenizer import build_tokenizer

SPLIT_NAMES = ("train", "validation", "test")
_REMAKE = "python -m titan_core.data.preprocess"


def split_ranges(split: str, num_items: int) -> list[tuple[int, int] | None]:
    """The ``[begin, end)`` item range of each split (None: not built), as megatron-core's
    dataset builder computes it for a dataset of ``num_items`` sequences."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [
        None if m is None else (round(m[0] * float(num_items)), round(m[1] * float(num_items)))
        for m in matrix
    ]


def used_splits(cfg: PretrainConfig) -> tuple[bool, bool, bool]:
    """Which of (train, validation, test) a run reads; only these are built."""
    return True, bool(cfg.train.eval_interval), False


def check_split(cfg: PretrainConfig, where: str, lengths: np.ndarray) -> None:
    """Every used split of a dataset with these sequence ``lengths`` gets tokens."""
    n = len(lengths)
    ranges = split_ranges(cfg.data.split, n)
    for name, used, span in zip(SPLIT_NAMES, used_splits(cfg), ranges, strict=True):
        if not used:
            continue
        begin, end = span or (0, 0)
        if end > begin and int(lengths[begin:end].sum(dtype=np.int64)) > 0:
            continue
        got = f"{end - begin} of the {n} documents" + (" (all empty)" if end > begin else "")
        if name == "train":
            fix = "raise the first weight of data.split or add documents"
        else:
            share = f"give it a larger share (e.g. data.split={n - 1},1,0)" if n > 1 else ""
            fix = f"{share or 'a validation split needs 2 documents'}, add documents, or turn "
            fix += "evaluation off (unset train.eval_interval)"
        raise ConfigError(
            f"data.split={cfg.data.split} gives the {name} split {got} of {where}; {fix}"
        )


def check_files(prefix: str) -> IndexSummary:
    """The ``.bin``/``.idx`` pair exists, is intact and holds documents."""
    where = f"data.data_path {prefix}"
    for path in (Path(f"{prefix}.idx"), Path(f"{prefix}.bin")):
        if not path.is_file():
            raise ConfigError(
                f"{where}: no {path}; make the dataset with {_REMAKE} --output-prefix {prefix}"
            )
    try:
        summary = read_index(prefix)
    except (IndexedDataError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if summary.num_sequences == 0:
        raise ConfigError(
            f"{where}: {summary.idx_path} lists no documents (an empty dataset); make it from "
            f"a corpus with text ({_REMAKE})"
        )
    size = summary.bin_path.stat().st_size
    if size != summary.bin_bytes:
        what = "truncated or damaged" if size < summary.bin_bytes else "not the .idx's pair"
        raise ConfigError(
            f"{where}: {summary.bin_path} has {size} bytes, but {summary.idx_path} says it must "
            f"have {summary.bin_bytes} ({what}); restore both files or make them again "
            f"with {_REMAKE}"
        )
    return summary


def dataset_record(summary: IndexSummary, scan: bool) -> DatasetRecord | None:
    """The dataset's record; without a valid one, scan the ``.bin`` (when ``scan``) and cache
    the result next to it if the folder is writable."""
    record = read_record(summary.prefix, summary.num_sequences, summary.num_tokens)
    if record is not None or not scan:
        return record
    lo, hi = scan_token_id_range(summary)
    record = DatasetRecord(
        max_token_id=hi,
        min_token_id=lo,
        num_sequences=summary.num_sequences,
        num_tokens=summary.num_tokens,
    )
    with contextlib.suppress(OSError):  # a read-only dataset folder: scan again next time
        write_record(record_path(summary.prefix), record)
    return record


def check_tokens(
    prefix: str,
    record: DatasetRecord,
    tokenizer,  # noqa: ANN001 - a titan_core tokenizer
    vocab_limit: int,
) -> None:
    """The dataset was tokenized by ``tokenizer`` (or one it extends), and its ids are below
    ``vocab_limit``."""
    redo = (
        f"make the dataset again with the model's tokenizer ({_REMAKE} --tokenizer-type ... "
        "--tokenizer-model ...), or set data.tokenizer_type / data.tokenizer_model to the "
        "tokenizer it was made with"
    )
    ours = f"{tokenizer.unique_description} (vocabulary {tokenizer.vocab_size})"
    theirs = record.tokenizer
    if theirs is not None and (
        theirs.vocab_size > tokenizer.vocab_size
        or tokenizer.vocab_fingerprint(theirs.vocab_size) != theirs.vocab_sha256
    ):
        raise ConfigError(
            f"data.data_path {prefix} was tokenized with {theirs.name} (vocabulary "
            f"{theirs.vocab_size}), but the model's tokenizer is {ours}: {redo}"
        )
    made_by = f"made with {theirs.name}" if theirs else "of unknown origin"
    if record.min_token_id is not None and record.min_token_id < 0:
        raise ConfigError(
            f"data.data_path {prefix}: {prefix}.bin ({made_by}) holds the negative token id "
            f"{record.min_token_id} (padding or a marker written as a token?); token ids are "
            f"0 to {vocab_limit - 1}: {redo}"
        )
    if record.max_token_id >= vocab_limit:
        model = (
            "" if vocab_limit == tokenizer.vocab_size else f" and model.vocab_size={vocab_limit}"
        )
        raise ConfigError(
            f"data.data_path {prefix}: {prefix}.bin ({made_by}) holds token id "
            f"{record.max_token_id}, but the model's tokenizer {ours}{model} takes ids below "
            f"{vocab_limit}: {redo}"
        )


def check_data(cfg: PretrainConfig, rank: int = 0) -> None:
    """All data checks for a config; ``rank`` 0 also scans datasets that have no record."""
    d = cfg.data
    if d.type == "arithmetic":
        check_split(cfg, f"the arithmetic corpus (data.num_samples={d.num_samples})",
                    np.ones(d.num_samples, dtype=np.int32))  # fmt: skip
    if d.type != "indexed":
        return
    try:
        tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer_model: {e}") from None
    vocab_limit = min(tokenizer.vocab_size, cfg.model.vocab_size or tokenizer.vocab_size)
    prefixes, _ = d.blend()
    for prefix in prefixes:
        summary = check_files(prefix)
        check_split(cfg, f"data.data_path {prefix}", np.asarray(summary.sequence_lengths))
        record = dataset_record(summary, scan=rank == 0)
        if record is not None:
            check_tokens(prefix, record, tokenizer, vocab_limit)
