"""A megatron trainer that syncs to two supervised engines, has one killed (-9) and restarted
by its supervisor, then resyncs it alone; one process does it all (the trainer's transport
state must outlive the kill).

``python tests/sync/resync_worker.py --model-dir HF --log-dir D --out out.json --transports
distributed disk ...`` writes, per transport: the engines' versions after the kill (the
restarted one back on its start-up version), the resync's metrics, each engine's probe
scores against the trainer after it, and the versions at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path


def _version(url: str) -> str | None:
    from titan_rl.rollout import SGLangClient

    async def get() -> str | None:
        async with SGLangClient(url) as c:
            return await c.weight_version()

    return asyncio.run(get())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--transports", nargs="+", required=True)
    a = ap.parse_args()

    from tests.sync.trainer_setup import hf_trainer_chunks, perturb
    from titan_core.parallel.initialize import shutdown
    from titan_rl.actors.config import EngineServerConfig
    from titan_rl.actors.server import ServerProcess
    from titan_rl.sync import SyncConfig, WeightSync

    chunks = hf_trainer_chunks(a.model_dir)
    servers = [
        ServerProcess(
            EngineServerConfig(
                model_path=a.model_dir,
                backend="builtin",
                num_threads=1,
                log_dir=a.log_dir,
                startup_timeout_s=120,
                weight_version="0",
            ),
            name=f"resync-engine{i}",
        )  # fmt: skip
        for i in range(2)
    ]
    results = []
    try:
        for s in servers:
            s.start()
            s.watch(interval_s=0.2)
        victim, other = servers
        for i, transport in enumerate(a.transports):
            disk = {"disk": {"dir": str(Path(a.log_dir) / "disk")}} if transport == "disk" else {}
            sc = SyncConfig(transport=transport, bucket_bytes=64_000, check_every=1, **disk)
            ws = WeightSync(sc, [s.url for s in servers], a.model_dir)
            perturb(chunks, seed=10 + i)  # weights neither engine has seen
            version = f"v{i + 1}"
            ws.sync(chunks, step=i + 1, version=version)
            first = victim.pid
            os.killpg(first, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not (victim.alive() and victim.pid != first and _version(victim.url)):
                assert time.monotonic() < deadline, victim.log_tail()
                time.sleep(0.2)
            after_kill = [_version(s.url) for s in servers]
            metrics = ws.resync(chunks, [victim.url], version)
            results.append(
                {
                    "transport": transport,
                    "after_kill": after_kill,
                    "resync": metrics,
                    "check": ws.check(chunks),  # both engines against the trainer
                    "versions": [_version(s.url) for s in servers],
                    "sync_version": ws.version,
                }
            )
            ws.close()
    finally:
        for s in servers:
            s.stop()
        shutdown()
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
