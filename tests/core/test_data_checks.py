"""Datasets and configs checked where they enter (issue 24): a corpus too small for its
split, data from another tokenizer, damaged or empty .bin/.idx, and config mistakes are
refused at start-up with exit code 2 and a message naming the file and key, before any
process group or model is built; preprocessing leaves no half-written files behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.core.pretrain_runner import FAST, TINY, losses, run_pretrain
from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import PretrainConfig
from titan_core.data import preprocess
from titan_core.data.checks import check_data
from titan_core.data.gpt import build_gpt_datasets
from titan_core.data.indexed import write_indexed_dataset
from titan_core.data.record import DatasetRecord, record_path
from titan_core.data.tokenizer import ByteTokenizer, HFTokenizer
from titan_core.pretrain import main as pretrain_main

#: a 1-step run of a small model on an indexed dataset
RUN = [*FAST, "train.train_iters=1", "train.lr_warmup_iters=0", "data.type=indexed"]
BANNER = "titan pretrain:"  # printed once the process group is up


def _texts(num_docs: int, doc_len: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij +=0123456789"))
    return ["".join(rng.choice(letters, size=doc_len)) for _ in range(num_docs)]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _preprocess_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_core.data.preprocess", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _foreign_dataset(prefix: Path, docs: list[list[int]], dtype: type = np.int32) -> Path:
    """A .bin/.idx pair written by megatron-core directly (another tool: no Titan record)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def _hf_tokenizer(path: Path, extra: tuple[str, ...] = (), swap: bool = False) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = list("0123456789+=\n abcdefghij")
    if swap:
        chars[0], chars[1] = chars[1], chars[0]
    vocab = {"<|endoftext|>": 0, "<pad>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    vocab.update({t: len(vocab) + i for i, t in enumerate(extra)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(path))
    return path


def _pretrain(overrides: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """``python -m titan_core.pretrain`` in this process, for runs that must stop at start-up."""
    rc = pretrain_main(["--config", TINY, *overrides])
    out, err = capsys.readouterr()
    assert BANNER not in out  # nothing was built
    return rc, err


def _cfg(overrides: list[str]) -> PretrainConfig:
    return load_config(PretrainConfig, TINY, overrides)


# ---- 1. a corpus too small for its split ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_small_corpus_trains_and_an_empty_validation_split_is_refused(tmp_path):
    """20 documents: with the default split 98,2,0 the validation split gets none, and
    megatron-core looped forever building it even when no evaluation was configured."""
    src = _jsonl(tmp_path / "c.jsonl", _texts(20, 30))
    prefix = tmp_path / "c"
    proc = _preprocess_cli("--input", str(src), "--output-prefix", str(prefix))
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "run"
    run_pretrain(TINY, [*RUN, f"data.data_path=[{prefix}]", f"run.dir={run_dir}"], timeout=400)
    assert len(losses(run_dir)) == 1 and np.isfinite(losses(run_dir)[0])

    proc = run_pretrain(
        TINY,
        [*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'run2'}",
         "train.eval_interval=1"],
        timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.split=98,2,0" in proc.stderr and "of the 20 documents" in proc.stderr
    assert str(prefix) in proc.stderr and BANNER not in proc.stdout


@pytest.mark.timeout(120)  # megatron-core's split building looped forever on an empty split
@pytest.mark.parametrize(
    "num_docs, doc_len", [(1, 12), (2, 3000), (3, 40), (20, 30), (49, 7), (60, 5), (150, 9)]
)
@pytest.mark.parametrize("split", ["98,2,0", "90,10,0", "1,1,1"])
@pytest.mark.parametrize("evaluate", [False, True])
def test_split_is_checked_against_the_corpus(tmp_path, num_docs, doc_len, split, evaluate):
    """Either start-up refuses the split, naming data.split and the document count, or
    megatron-core builds every split the run reads, non-empty, in bounded time."""
    prefix = tmp_path / "c"
    write_indexed_dataset(
        (ByteTokenizer().tokenize(t) for t in _texts(num_docs, doc_len)), prefix, ByteTokenizer()
    )
    overrides = [*RUN, f"data.data_path=[{prefix}]", f"data.split={split}",
                 f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    if evaluate:
        overrides.append("train.eval_interval=1")
    cfg = _cfg(overrides)
    try:
        check_data(cfg)
    except ConfigError as e:
        assert f"data.split={split}" in str(e) and f"of the {num_docs} documents" in str(e)
        assert evaluate or "the train split" in str(e)  # an unused split is never refused
        return
    valid_samples = 16 if evaluate else 0
    train_ds, valid_ds = build_gpt_datasets(cfg, ByteTokenizer(), 16, valid_samples)
    assert len(train_ds) >= 16
    assert (valid_ds is not None and len(valid_ds) >= 16) if evaluate else valid_ds is None


@pytest.mark.parametrize("num_docs, refused", [(1, True), (2, True), (20, True), (50, False)])
def test_split_verdict_for_the_default_split(tmp_path, num_docs, refused):
    prefix = tmp_path / "c"
    write_indexed_dataset((list(b"some text") for _ in range(num_docs)), prefix, ByteTokenizer())
    cfg = _cfg([*RUN, f"data.data_path=[{prefix}]", "train.eval_interval=5",
                f"run.dir={tmp_path}"])  # fmt: skip
    if refused:
        with pytest.raises(ConfigError, match=f"validation split 0 of the {num_docs} documents"):
            check_data(cfg)
    else:
        check_data(cfg)


def test_arithmetic_corpus_too_small_for_evaluation():
    cfg = _cfg(["data.num_samples=20", "train.eval_interval=10"])
    with pytest.raises(ConfigError, match=r"data.split=98,2,0 .*data.num_samples=20"):
        check_data(cfg)
    check_data(_cfg(["data.num_samples=20"]))  # no evaluation: the split is not built


def test_a_blend_checks_every_dataset(tmp_path):
    big, small = tmp_path / "big", tmp_path / "small"
    write_indexed_dataset((list(b"abc") for _ in range(100)), big, ByteTokenizer())
    write_indexed_dataset((list(b"abc") for _ in range(3)), small, ByteTokenizer())
    cfg = _cfg([*RUN, f"data.data_path=[0.7,{big},0.3,{small}]", "train.eval_interval=5",
                f"run.dir={tmp_path}"])  # fmt: skip
    with pytest.raises(ConfigError, match=f"of the 3 documents of data.data_path {small}"):
        check_data(cfg)


# ---- 2. data from another tokenizer ---------------------------------------------------------


def test_preprocess_records_the_tokenizer(tmp_path):
    texts = _texts(5, 20, seed=3)
    tok_file = _hf_tokenizer(tmp_path / "tok.json")
    prefix = tmp_path / "c"
    rc = preprocess.main(["--input", str(_jsonl(tmp_path / "c.jsonl", texts)),
                          "--output-prefix", str(prefix), "--tokenizer-type", "hf",
                          "--tokenizer-model", str(tok_file)])  # fmt: skip
    assert rc == 0
    tok = HFTokenizer(str(tok_file))
    record = DatasetRecord.model_validate_json(record_path(prefix).read_text())
    assert record.tokenizer is not None and str(tok_file) in record.tokenizer.name
    assert record.tokenizer.vocab_size == tok.vocab_size == 26
    assert record.max_token_id == max(max(tok.tokenize(t)) for t in texts)
    assert record.num_sequences == 5
    assert record.num_tokens == sum(len(tok.tokenize(t)) + 1 for t in texts)


def test_data_from_another_tokenizer_is_refused(tmp_path, capsys):
    """Ids of a 26-token tokenizer all fit the byte tokenizer's 258: it trained silently.
    (Both commands' ``main`` in this process; a start-up refusal through the process
    itself: test_a_truncated_bin_is_refused_at_start_up.)"""
    tok_file = _hf_tokenizer(tmp_path / "tok.json")
    prefix = tmp_path / "c"
    rc = preprocess.main(["--input", str(_jsonl(tmp_path / "c.jsonl", _texts(300, 20))),
                          "--output-prefix", str(prefix), "--tokenizer-type", "hf",
                          "--tokenizer-model", str(tok_file)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    rc, err = _pretrain([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'r'}"], capsys)
    assert rc == 2
    assert f"data.data_path {prefix}" in err
    assert "vocabulary 26" in err and "ByteTokenizer (vocabulary 258)" in err
    assert "data.tokenizer_type" in err and "preprocess" in err


def test_a_tokenizer_that_extends_the_datasets_is_accepted(tmp_path):
    prefix = tmp_path / "c"
    made_with = HFTokenizer(str(_hf_tokenizer(tmp_path / "a.json")))
    write_indexed_dataset((made_with.tokenize(t) for t in _texts(200, 20)), prefix, made_with)
    base = [*RUN, f"data.data_path=[{prefix}]", "data.tokenizer_type=hf", f"run.dir={tmp_path}"]
    extended = _hf_tokenizer(tmp_path / "b.json", extra=("<|im_start|>", "<|im_end|>"))
    check_data(_cfg([*base, f"data.tokenizer_model={extended}"]))
    check_data(_cfg([*base, f"data.tokenizer_model={tmp_path / 'a.json'}"]))
    swapped = _hf_tokenizer(tmp_path / "c.json", swap=True)  # same size, other ids
    with pytest.raises(ConfigError, match="was tokenized with HFTokenizer"):
        check_data(_cfg([*base, f"data.tokenizer_model={swapped}"]))


@pytest.mark.parametrize("bad_id", [258, 300, 5000])
def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, capsys, bad_id):
    """258 and 300 fall on the padding rows (trained silently), 5000 past the embedding
    (an IndexError at step 1): the dataset has no record, so its ids are scanned."""
    rng = np.random.default_rng(bad_id)
    docs = [rng.integers(0, 256, size=40).tolist() for _ in range(300)]
    docs[123][7] = bad_id
    prefix = _foreign_dataset(tmp_path / "foreign", docs)
    rc, err = _pretrain([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'r'}"], capsys)
    assert rc == 2
    assert f"data.data_path {prefix}" in err and f"token id {bad_id}" in err
    assert "ByteTokenizer (vocabulary 258)" in err
    cached = DatasetRecord.model_validate_json(record_path(prefix).read_text())
    assert cached.max_token_id == bad_id and cached.tokenizer is None


def test_a_foreign_dataset_within_the_vocabulary_is_accepted_and_its_scan_cached(tmp_path):
    docs = [[1, 2, 257], [255, 256, 3]]
    prefix = _foreign_dataset(tmp_path / "ok", docs * 60, dtype=np.uint16)
    check_data(_cfg([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path}"]))
    assert DatasetRecord.model_validate_json(record_path(prefix).read_text()).max_token_id == 257


def test_a_stale_record_is_not_trusted(tmp_path):
    """A dataset rewritten by another tool next to an old record: the ids are scanned again."""
    prefix = tmp_path / "c"
    write_indexed_dataset((list(b"hello") for _ in range(100)), prefix, ByteTokenizer())
    _foreign_dataset(prefix, [[1, 2, 3, 999]] * 100)
    with pytest.raises(ConfigError, match="token id 999"):
        check_data(_cfg([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path}"]))


# ---- 3. damaged and empty datasets ----------------------------------------------------------


def _byte_dataset(tmp_path: Path, num_docs: int = 200) -> Path:
    prefix = tmp_path / "c"
    write_indexed_dataset((list(t.encode()) for t in _texts(num_docs, 30)), prefix, ByteTokenizer())
    return prefix


def test_a_truncated_bin_is_refused_at_start_up(tmp_path):
    prefix = _byte_dataset(tmp_path)
    bin_path = Path(f"{prefix}.bin")
    size = bin_path.stat().st_size
    with open(bin_path, "r+b") as f:
        f.truncate(size - 10)
    proc = run_pretrain(TINY, [*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'r'}",
                               "train.eval_interval=1"], check=False)  # fmt: skip
    assert proc.returncode == 2 and BANNER not in proc.stdout
    assert f"{bin_path} has {size - 10} bytes" in proc.stderr
    assert f"{prefix}.idx says it must have {size}" in proc.stderr


@pytest.mark.parametrize("change", [-1, -4000, "empty", 2])
def test_a_bin_of_the_wrong_size_is_refused(tmp_path, capsys, change):
    prefix = _byte_dataset(tmp_path)
    bin_path = Path(f"{prefix}.bin")
    size = bin_path.stat().st_size
    data = bin_path.read_bytes()
    new = b"" if change == "empty" else data[:change] if change < 0 else data + b"\0" * change
    bin_path.write_bytes(new)
    rc, err = _pretrain([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and f"{bin_path} has {len(new)} bytes" in err and f"have {size}" in err


@pytest.mark.parametrize("keep", [0, 20, 40])
def test_a_damaged_idx_is_refused(tmp_path, capsys, keep):
    prefix = _byte_dataset(tmp_path)
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(
        idx.read_bytes()[:keep] if keep else b"not a Megatron index at all, just some text"
    )
    rc, err = _pretrain([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and f"{idx} is" in err and "preprocess" in err


def test_an_empty_dataset_is_named(tmp_path, capsys):
    prefix = _foreign_dataset(tmp_path / "empty", [])
    rc, err = _pretrain([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and f"{prefix}.idx lists no documents" in err


def test_preprocessing_an_empty_file_fails_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("")
    out = tmp_path / "out"
    out.mkdir()
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "d")])
    assert rc == 2 and f"{src}: no documents" in capsys.readouterr().err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("content", ["\n\n", '{"title": "x"}\n{"body": 1}\n', '{"text": 3}\n'])
def test_preprocessing_no_text_fails_and_writes_nothing(tmp_path, capsys, content):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "d")])
    assert rc == 2 and f"{src}: no documents" in capsys.readouterr().err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    "bad_line, needle", [(b"{broken\n", "not valid JSON"), (b'{"text": "\xff\xfe"}\n', ":3:")]
)
def test_failed_preprocessing_removes_its_temporary_files(tmp_path, capsys, bad_line, needle):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "one"}\n{"text": "two"}\n' + bad_line + b'{"text": "four"}\n')
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "d")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{src}:3" in err and needle in err
    assert list(out.iterdir()) == []  # no d.tmp<pid>.bin, no half dataset


# ---- 5. config mistakes that crashed at step 1 ----------------------------------------------


@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
def test_seq_length_above_max_position_embeddings(tmp_path, capsys, positions):
    rc, err = _pretrain(
        ["model.seq_length=96", "model.max_position_embeddings=64",
         f"model.position_embedding_type={positions}", f"run.dir={tmp_path}"],
        capsys,
    )  # fmt: skip
    assert rc == 2
    assert "model.seq_length (96)" in err and "model.max_position_embeddings (64)" in err


@pytest.mark.parametrize("present", [(), (".bin",), (".idx",)])
def test_a_missing_dataset_file_is_named(tmp_path, capsys, present):
    prefix = _byte_dataset(tmp_path)
    for ext in (".bin", ".idx"):
        if ext not in present:
            Path(f"{prefix}{ext}").unlink()
    missing = ".idx" if ".idx" not in present else ".bin"
    rc, err = _pretrain([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and f"no {prefix}{missing}" in err


@pytest.mark.parametrize("key", ["run.dir", "checkpoint.save", "data.cache_dir"])
def test_an_unwritable_output_folder_is_named(tmp_path, capsys, key):
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where a folder must be")
    overrides = [f"run.dir={tmp_path / 'run'}", f"{key}={blocker / 'sub'}"]
    rc, err = _pretrain(overrides, capsys)
    assert rc == 2 and f"{key} {blocker / 'sub'} is not a writable folder" in err


@pytest.mark.parametrize(
    "override, needle",
    [
        (["data.split=98;2"], "data.split '98;2' must be"),
        (["data.split=98,2,0,1"], "data.split '98,2,0,1' must be"),
        (["data.split=0,100,0"], "gives training no share"),
        (["data.split=100,0,0", "train.eval_interval=5"], "train.eval_interval needs a validation"),
        (["data.type=indexed", "data.data_path=[0.5,a,b]"], "pairs of weight and prefix"),
        (["data.type=indexed", "data.data_path=[0,a,1,b]"], "weights must be positive"),
        (["data.type=indexed", "data.data_path=[x,a,0.5,b]"], "pairs of weight and prefix"),
        (["data.type=indexed", "data.data_path=['0',a,'1',b]"], "weights must be positive"),
        (["model.seq_length=200"], "model.seq_length (200) exceeds"),
    ],
)
def test_data_and_model_config_mistakes_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert needle in str(e.value)


def test_a_cancelled_preprocessing_removes_its_temporary_files(tmp_path):
    """SIGTERM (a job scheduler's cancel) while reading the input: nothing is left behind."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)  # preprocessing blocks reading it, its temporary .bin already open
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "titan_core.data.preprocess", "--input", str(fifo),
           "--output-prefix", str(out / "d")]  # fmt: skip
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) as p:
        deadline = time.monotonic() + 240
        while not list(out.glob("d.tmp*.bin")) and p.poll() is None:
            assert time.monotonic() < deadline, "preprocessing never opened its output"
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM
    assert list(out.iterdir()) == []


def test_a_missing_tokenizer_is_named(tmp_path, capsys):
    prefix = _byte_dataset(tmp_path)
    missing = tmp_path / "nowhere" / "tokenizer.json"
    rc, err = _pretrain([*RUN, f"data.data_path=[{prefix}]", "data.tokenizer_type=hf",
                         f"data.tokenizer_model={missing}", f"run.dir={tmp_path / 'r'}"],
                        capsys)  # fmt: skip
    assert rc == 2 and f"data.tokenizer_model: no tokenizer at {missing}" in err


def test_negative_token_ids_are_refused(tmp_path, capsys):
    """-1 written as padding by another tool (int32 ids): an embedding lookup would index
    from the end of the table, silently."""
    docs = [[5, 6, 7, -1, -1] for _ in range(200)]
    prefix = _foreign_dataset(tmp_path / "padded", docs, dtype=np.int32)
    rc, err = _pretrain([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path / 'r'}"], capsys)
    assert rc == 2
    assert f"data.data_path {prefix}" in err and "negative token id -1" in err
    cached = DatasetRecord.model_validate_json(record_path(prefix).read_text())
    assert (cached.min_token_id, cached.max_token_id) == (-1, 7)


def test_a_record_without_the_smallest_id_is_scanned_again(tmp_path):
    """Records written before ``min_token_id`` was kept are not trusted for it."""
    prefix = _foreign_dataset(tmp_path / "old", [[3, -2, 4]] * 100, dtype=np.int32)
    old = DatasetRecord(max_token_id=4, num_sequences=100, num_tokens=300)
    record_path(prefix).write_text(old.model_dump_json(exclude={"min_token_id"}))
    with pytest.raises(ConfigError, match="negative token id -2"):
        check_data(_cfg([*RUN, f"data.data_path=[{prefix}]", f"run.dir={tmp_path}"]))
