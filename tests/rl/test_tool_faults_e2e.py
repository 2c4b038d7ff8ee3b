"""The real GRPO job (Ray, a Megatron trainer actor, the built-in engine) with a multi-turn
rollout hook whose sync tool never returns (tests/rl/stuck_tool.py; issue 33): each call is
answered after its timeout and counted (``tools/timeouts``), more calls stay stuck than
asyncio's default executor has threads (``tools/stuck``), yet every step and eval finishes
and the job exits promptly after its last record. Before, the stuck calls held all of
asyncio's default executor's threads: the driver's own ``asyncio.to_thread`` calls waited
behind them for good (the run stalled at step 1's record), and the interpreter joins those
threads at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_core.training.metrics import read_metrics
from titan_rl.rollout.tools import DEFAULT_WORKERS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
#: asyncio's default executor's threads (ThreadPoolExecutor's default)
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)
#: from the last record to the exit: engines, trainers and Ray stopped (2 busy cores)
EXIT_WITHIN_S = 60.0
#: the longest wait for the next record (a step, or the start-up to step 0's eval)
STALLED_AFTER_S = 240.0


def _records(path: Path) -> list[dict]:
    return read_metrics(path) if path.exists() else []


def test_a_never_returning_tool_neither_stalls_the_run_nor_holds_its_exit(
    tmp_path: Path, math_tool_run
):
    run_dir = tmp_path / "grpo"
    # any base of the example's model will do (every turn with any text calls the stuck
    # tool): the one test_math_tool_e2e's job pretrained (tests/rl/conftest.py)
    base = math_tool_run.base
    assert math_tool_run.proc.returncode == 0, math_tool_run.proc.stderr[-6000:]
    out, err = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_rl.grpo", "--config", str(REPO / "examples/math_tool.yaml"),
         f"policy.load={base / 'checkpoints'}", f"run.dir={run_dir}", "run.num_steps=2",
         "run.eval_interval=2", "run.save_interval=0",
         "data.num_eval=16", "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4",
         "train.micro_batch_size=32", "train.ppo_steps=1",
         "rollout.generate_fn=tests/rl/stuck_tool.py:generate"],
        stdout=out, stderr=err, text=True, cwd=REPO,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    # before, the stuck calls filled asyncio's default executor and the driver stalled for
    # good in step 1's record (the engine recovery's report runs there): no record after
    # step 0's, and a SIGTERM could not stop it either
    seen, last_record_at = 0, None
    deadline = time.monotonic() + 2 * STALLED_AFTER_S  # start-up
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            records = _records(metrics)
            if len(records) > seen and last_record_at is None:
                seen, deadline = len(records), time.monotonic() + STALLED_AFTER_S
            if last_record_at is None and any(
                r.get("step") == 2 and "reward/mean" in r for r in records
            ):
                last_record_at = time.monotonic()
                deadline = last_record_at + EXIT_WITHIN_S
            time.sleep(0.5)
        exited_at = time.monotonic()
        running = proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    logs = (tmp_path / "stdout.txt").read_text()[-3000:] + (tmp_path / "stderr.txt").read_text()
    assert last_record_at is not None, (
        f"the run stalled: no record for {STALLED_AFTER_S:g} s after "
        f"{_records(metrics)[-1:] or 'start-up'}\n{logs[-6000:]}"
    )
    assert not running, f"the job did not exit within {EXIT_WITHIN_S:g} s of its last record"
    assert proc.returncode == 0, logs[-6000:]
    print(f"exit {exited_at - last_record_at:.1f} s after the last record")

    records = _records(metrics)
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["tools/timeouts"] >= 1 and r["rollout/tool_error_rate"] == 1.0, r
    # more calls stuck at once than asyncio's default executor has threads (a tool's own
    # threads are bounded by its ToolWorkers' max_threads)
    stuck = max(r["tools/stuck"] for r in steps)
    assert stuck >= min(DEFAULT_EXECUTOR_THREADS + 1, DEFAULT_WORKERS.max_threads), steps
    assert stuck <= DEFAULT_WORKERS.max_threads
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]
    assert "tool timeouts" in (tmp_path / "stdout.txt").read_text()
