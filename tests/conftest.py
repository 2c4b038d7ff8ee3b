"""Shared test set-up: keep torch single-threaded per process so multi-process tests on 2
cores don't oversubscribe; the demo's base policy, pretrained once per session."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    """examples/math.yaml's base policy (a Titan checkpoint folder), pretrained by its own
    recipe (~2 minutes), shared by the GRPO and slime end-to-end tests."""
    d = tmp_path_factory.mktemp("base")
    subprocess.run(
        [sys.executable, "-m", "titan_core.pretrain", "--config",
         str(REPO / "examples/pretrain_math_base.yaml"), f"run.dir={d}"],
        check=True, capture_output=True, cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="2"),  # alone on the machine, as `make demo` runs it
    )  # fmt: skip
    return d / "checkpoints"
