"""``python -m titan_core.data.preprocess``: JSONL text -> Megatron .bin/.idx.

    python -m titan_core.data.preprocess --input corpus.jsonl --output-prefix data/corpus \
        --json-key text --tokenizer-type hf --tokenizer-model path/to/tokenizer.json
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator

import orjson
from tqdm import tqdm

from titan_core.data.indexed import EmptyDatasetError, write_indexed_dataset
from titan_core.data.tokenizer import build_tokenizer


class DatasetFormatError(ValueError):
    """The input file is not JSONL with the expected key."""


def _documents(path: str, key: str, tokenizer, skipped: list[int]) -> Iterator[list[int]]:  # noqa: ANN001
    with open(path, "rb") as f:
        for lineno, line in enumerate(tqdm(f, desc=f"tokenizing {path}", unit=" docs"), 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise DatasetFormatError(f"{path}:{lineno}: not valid JSON ({e})") from None
            text = row.get(key) if isinstance(row, dict) else None
            if not isinstance(text, str):
                skipped.append(lineno)
                continue
            yield tokenizer.tokenize(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_core.data.preprocess", description=__doc__)
    ap.add_argument("--input", required=True, help="JSONL file, one document per line")
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--tokenizer-type", choices=["byte", "hf"], default="byte")
    ap.add_argument("--tokenizer-model", default=None)
    ap.add_argument("--no-append-eod", action="store_true")
    args = ap.parse_args(argv)
    skipped: list[int] = []
    try:
        tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        record = write_indexed_dataset(
            _documents(args.input, args.json_key, tok, skipped),
            args.output_prefix,
            tok,
            append_eod=not args.no_append_eod,
        )
    except EmptyDatasetError:
        why = f"; {len(skipped)} rows had no string {args.json_key!r}" if skipped else ""
        print(
            f"error: {args.input}: no documents with text{why}; nothing written "
            f"(check the file and --json-key)",
            file=sys.stderr,
        )
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = record.num_sequences
    print(
        f"wrote {n} documents ({record.num_tokens} tokens) to {args.output_prefix}.bin/.idx",
        end="",
    )
    if skipped:
        print(
            f"; skipped {len(skipped)} rows without a string {args.json_key!r} "
            f"(first at line {skipped[0]})",
            end="",
        )
    print()
    return 0


if __name__ == "__main__":
    # A cancelled job (SIGTERM) unwinds like an error, so no temporary file is left behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    raise SystemExit(main())
