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

import torch


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

    from titan_core.config.pretrain import PretrainConfig
    from titan_core.models.gpt import (
        build_model_chunks,
        build_transformer_config,
        padded_vocab_size,
    )
    from titan_core.models.hf import HFBridge, model_config_from_hf
    from titan_core.parallel.initialize import initialize, shutdown
    from titan_rl.actors import EngineServerConfig, ServerProcess
    from titan_rl.sync import SyncConfig, WeightSync

    model = model_config_from_hf(a.model_dir, seq_length=32, transformer_impl="local")
    cfg = PretrainConfig.model_validate(
        {"model": model.model_dump(), "train": {"micro_batch_size": 1, "global_batch_size": 8}}
    )
    accel, _, _ = initialize(cfg)
    chunks = build_model_chunks(
        cfg, build_transformer_config(cfg, accel), padded_vocab_size(model.vocab_size, cfg), accel
    )
    HFBridge(a.model_dir).load(chunks, a.model_dir)
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
            sc = SyncConfig(
                transport=transport, bucket_bytes=64_000, disk_dir=str(Path(a.log_dir) / "disk"),
                check_every=1,
            )  # fmt: skip
            ws = WeightSync(sc, [s.url for s in servers], a.model_dir)
            with torch.no_grad():  # weights neither engine has seen
                g = torch.Generator().manual_seed(10 + i)
                for chunk in chunks:
                    for p in chunk.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
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
