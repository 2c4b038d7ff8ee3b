"""Run ``titan_core.pretrain`` as a user would (python -m / torchrun) and read its metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from titan_core.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "examples" / "pretrain_tiny.yaml")
TINY_MOE = str(REPO / "examples" / "pretrain_tiny_moe.yaml")

#: A small, fast shape shared by the numerical tests (fp32; the default vocabulary padding,
#: which differs between TP sizes for a new model: a loaded one keeps its checkpoint's rows).
FAST = [
    "model.seq_length=64",
    "model.max_position_embeddings=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=16",
    "train.lr_warmup_iters=1",
    "checkpoint.save_interval=0",
    "data.num_samples=20000",
]


def run_pretrain(
    config: str,
    overrides: list[str],
    nproc: int = 1,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "-m", "titan_core.pretrain", "--config", config, *overrides]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", "-m", "titan_core.pretrain", "--config", config, *overrides,
        ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # Own process group, so a timeout kills torchrun's workers too, not only torchrun.
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    ) as p:  # fmt: skip
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise AssertionError(
                f"{' '.join(cmd)} timed out after {timeout}s\n{err[-4000:]}"
            ) from None
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def losses(run_dir: str | Path) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl")]
