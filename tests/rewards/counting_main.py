"""A driver's main module for the worker-replacement test: every import of it is logged to
``$COUNTING_MAIN_LOG``, and an import as multiprocessing's ``__mp_main__`` (a child running
its parent's main module again) costs 2 s, as ``python -m titan_rl.grpo``'s does (torch).

Run as ``python -m tests.rewards.counting_main`` or by path: scores ``--hangs`` timed-out
calls and one good one on a one-worker RewardPool and prints the JSON of what it measured.
"""

from __future__ import annotations

import os
import time

with open(os.environ["COUNTING_MAIN_LOG"], "a") as _log:
    _log.write(f"{__name__} {os.getpid()}\n")
if __name__ == "__mp_main__":
    time.sleep(2.0)


def main() -> None:
    import argparse
    import asyncio
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from titan_rl.rewards import RewardConfig, RewardPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--hangs", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=0.3)
    args = ap.parse_args()
    cfg = RewardConfig(
        type="custom", custom_path="tests.rewards.fault_fns:by_response",
        timeout_s=args.timeout_s, num_workers=1,
    )  # fmt: skip
    pool = RewardPool(cfg)

    async def score(responses: list[str]) -> list:
        n = len(responses)
        return await pool.score(["p"] * n, responses, ["l"] * n, [{}] * n)

    try:
        asyncio.run(score(["ok"]))  # the forkserver and the first worker
        t0 = time.perf_counter()
        got = asyncio.run(score(["hang"] * args.hangs + ["ok"]))
        wall = time.perf_counter() - t0
    finally:
        pool.close()
    print(json.dumps({
        "statuses": [r.status for r in got],
        "per_replacement_s": (wall - args.hangs * args.timeout_s) / args.hangs,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
