"""What replacing a reward worker costs: a reward that times out on every sample, scored by
a ``RewardPool`` of one worker, so each call after the first waits for the worker that the
previous timeout killed to be replaced.

This script imports ``titan_rl.grpo`` as the GRPO driver's ``__main__`` does (torch and the
config stack), so a worker that re-imported its parent's main module pays what one started by
``python -m titan_rl.grpo`` would. Prints the wall time of ``--calls`` timed-out calls and the
cost per replacement: (wall - calls x timeout_s) / calls, for RewardPool's workers and, with
``--stock``, for multiprocessing's own forkserver context (whose children run the parent's
main module again: what RewardPool used before).

    python bench/reward_worker_replacement.py [--calls 8] [--timeout-s 0.2] [--stock]

Measured on 2 shared CPU cores (8 calls of 0.2 s): 0.11-0.12 s per replacement; with
--stock 1.9 s (load ~1) to 3.1 s (load ~12): the child's import of titan_rl.grpo.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import titan_rl.grpo  # noqa: E402,F401  (the driver's main module: what a worker would re-import)
from titan_rl.rewards import RewardConfig, RewardPool, pool  # noqa: E402

HANG = "tests.rewards.fault_fns:by_response"


def measure(calls: int, timeout_s: float, label: str) -> None:
    cfg = RewardConfig(type="custom", custom_path=HANG, timeout_s=timeout_s, num_workers=1)
    rewards = RewardPool(cfg)

    async def score(responses: list[str]) -> list:
        n = len(responses)
        return await rewards.score(["p"] * n, responses, ["l"] * n, [{}] * n)

    try:
        t0 = time.perf_counter()
        asyncio.run(score(["ok"]))  # the first worker (and the forkserver) started
        start = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = asyncio.run(score(["hang"] * calls))
        wall = time.perf_counter() - t0
    finally:
        rewards.close()
    assert all(r.status == "timeout" for r in got), got
    per = (wall - calls * timeout_s) / calls
    print(
        f"{label}: first worker ready {start:.2f} s; {calls} timed-out calls of {timeout_s} s "
        f"{wall:.2f} s; per worker replacement {per:.3f} s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=0.2)
    ap.add_argument("--stock", action="store_true", help="also multiprocessing's own context")
    args = ap.parse_args()
    measure(args.calls, args.timeout_s, "RewardPool")
    if args.stock:
        pool._WorkerContext = lambda: multiprocessing.get_context("forkserver")  # type: ignore
        measure(args.calls, args.timeout_s, "stock forkserver")


if __name__ == "__main__":
    main()
