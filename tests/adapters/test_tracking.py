"""The drivers' records reach slime's and miles' own trackers (adapters/common/tracking.py),
as ``python -m adapters.slime.train`` / ``adapters.miles.train`` call it: parsed by the
driver's own parser from the tracking flags, started, one ``log`` per metrics.jsonl record,
finished. Read back with each tracker's own reader: TensorBoard's event files
(``EventAccumulator``), wandb's offline run file (its ``Record`` protobuf), MLflow's file
store (``MlflowClient``), Prometheus' ``/metrics`` page."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("slime.observability.logging_utils", reason="slime's wheel is needed")
pytest.importorskip("miles.utils.tracking_utils.tracking", reason="miles' wheel is needed")
pytest.importorskip("tensorboard", reason="pip install -e .[peers]")

from adapters.common.tracking import Tracking  # noqa: E402
from titan_core.config import ConfigError  # noqa: E402

BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "2",
        "--global-batch-size", "4", "--custom-rm-path", "adapters.slime.rewards.exact_match"]  # fmt: skip
#: what the drivers write to metrics.jsonl: the eval before RL, then one record per rollout
RECORDS: list[dict[str, Any]] = [
    {"step": 0, "eval/accuracy": 0.25},
    {"step": 1, "reward/mean": 0.5, "train/loss": 0.125, "eval/accuracy": 0.5, "time/step": 1.5},
    {"step": 2, "reward/mean": 0.75, "train/loss": 0.0625, "time/step": 2.5},
]
#: slime's steps for RECORDS: rollout/step and eval/step the rollout id, train/step the
#: rollout's first optimizer step (8 samples per rollout, 4 per step)
EXPECTED = {
    "eval/accuracy": [(0, 0.25), (0, 0.5)],
    "reward/mean": [(0, 0.5), (1, 0.75)],
    "time/step": [(0, 1.5), (1, 2.5)],
    "train/loss": [(0, 0.125), (2, 0.0625)],
}


def _parse(framework: str, argv: list[str]) -> Any:
    if framework == "slime":
        from adapters.slime.arguments import parse_args
    else:
        from adapters.miles.arguments import parse_args
    return parse_args([*BASE, *argv])


def _run(framework: str, argv: list[str], run_dir: Path) -> Any:
    """The driver's calls: start, log each record, finish."""
    args = _parse(framework, argv)
    tracking = Tracking(args, framework, run_dir)
    try:
        for rec in RECORDS:
            tracking.log(rec)
    finally:
        tracking.finish()
    return args


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _wandb_history(wandb_dir: Path) -> list[dict[str, Any]]:
    """The history rows of the one offline run under ``wandb_dir``: its ``run-*.wandb`` file
    is a LevelDB-style log (7-byte file header, 32 KiB blocks, 7-byte chunk headers) of
    wandb's ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunk, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.HasField("history"):
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def _without_wandb_keys(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("_")}


#: the wandb rows slime logs for RECORDS: one per group, with its step key
WANDB_ROWS = [
    {"eval/accuracy": 0.25, "eval/step": 0},
    {"reward/mean": 0.5, "time/step": 1.5, "rollout/step": 0},
    {"train/loss": 0.125, "train/step": 0},
    {"eval/accuracy": 0.5, "eval/step": 0},
    {"reward/mean": 0.75, "time/step": 2.5, "rollout/step": 1},
    {"train/loss": 0.0625, "train/step": 2},
]


def test_slime_tensorboard_and_wandb_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # slime's default folder: ./tensorboard_log/<project>/<name>
    monkeypatch.setenv("WANDB_MODE", "offline")  # slime sets it from --wandb-mode; restored
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    args = _run("slime", ["--use-tensorboard", "--tb-project-name", "proj",
                          "--tb-experiment-name", "exp", "--use-wandb", "--wandb-mode", "offline",
                          "--wandb-dir", str(tmp_path / "wb"), "--wandb-project", "titan"],
                tmp_path / "run")  # fmt: skip
    assert _tensorboard_scalars(tmp_path / "tensorboard_log/proj/exp") == EXPECTED
    assert [_without_wandb_keys(r) for r in _wandb_history(tmp_path / "wb")] == WANDB_ROWS
    assert args.wandb_group == "run" and args.wandb_run_id  # the run folder's name; slime's id


def test_miles_tensorboard_mlflow_and_wandb_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = f"file:{tmp_path / 'mlruns'}"
    args = _run("miles", ["--use-tensorboard", "--use-mlflow", "--mlflow-tracking-uri", store,
                          "--mlflow-experiment-name", "titan", "--use-wandb",
                          "--wandb-group", "g", "--wandb-dir", str(tmp_path / "wb")],
                tmp_path / "run")  # fmt: skip
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker set it
    assert _tensorboard_scalars(tmp_path / "tb") == EXPECTED
    assert [_without_wandb_keys(r) for r in _wandb_history(tmp_path / "wb")] == WANDB_ROWS
    client = MlflowClient(store)
    for key, points in {**EXPECTED, "rollout/step": [(0, 0.0), (1, 1.0)]}.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(args.mlflow_run_id, key))
        assert got == sorted(points), key
    assert client.get_run(args.mlflow_run_id).data.params["rollout_batch_size"] == "4"


def test_tensorboard_with_no_folder_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    with pytest.raises(ConfigError, match="tb_project_name"):
        Tracking(_parse("slime", ["--use-tensorboard"]), "slime", Path("run"))


def test_no_tracker_flag_logs_nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _run("slime", [], tmp_path / "run")
    _run("miles", [], tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_miles_prometheus_serves_the_records(tmp_path: Path) -> None:
    """``--use-prometheus``: miles' collector actor (on the driver's Ray) serves each metric's
    latest value on ``--prometheus-port``."""
    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = _parse("miles", ["--use-prometheus", "--prometheus-port", str(port),
                            "--prometheus-run-name", "titan"])  # fmt: skip
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        tracking = Tracking(args, "miles", tmp_path / "run")
        for rec in RECORDS:
            tracking.log(rec)
        want = {'miles_metric_reward_mean{run_name="titan"} 0.75',
                'miles_metric_train_loss{run_name="titan"} 0.0625',
                'miles_metric_eval_accuracy{run_name="titan"} 0.5',
                'miles_metric_rollout_step{run_name="titan"} 1.0'}  # fmt: skip
        for _ in range(100):  # the collector's updates are asynchronous
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            if want <= set(page.splitlines()):
                break
            time.sleep(0.1)
        assert want <= set(page.splitlines()), page
        tracking.finish()
    finally:
        ray.shutdown()
