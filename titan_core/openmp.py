"""How this process's OpenMP threads wait, in the words its start-up line prints (the trainer's
and the engine's; tests/rl/test_threads.py reads them back)."""

from __future__ import annotations

import os


def wait_said() -> str:
    """``(GOMP_SPINCOUNT=..., OMP_WAIT_POLICY=..., niceness N)``, each variable as this process
    got it (``unset`` where it has none)."""
    spin = os.environ.get("GOMP_SPINCOUNT", "unset")
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    return f"(GOMP_SPINCOUNT={spin}, OMP_WAIT_POLICY={policy}, niceness {os.nice(0)})"
