"""A megatron trainer process that syncs its weights to running engines and reports.

``python tests/sync/sync_worker.py --engines URL.. --model-dir HF --out out.json
--transports tensor disk ...`` (torchrun for TP / PP > 1). Before each transport's sync the trainer's
weights are perturbed in place, so every sync carries weights the engine has not seen.
``tensor-direct`` is the tensor transport with ``sync.tensor.format=direct``; ``--syncs N``
syncs N times per transport (perturbing before each), reporting each in ``rounds``.
``--supervised``: the engines are supervised (an unreachable one is lost, not a failure);
a transport named with ``+supervised`` (``tensor+supervised``) is synced that way alone.
``--no-check-before``: no parity check before the sync (it needs every engine to answer).
Each result's ``engine_versions``: every engine's weight version after that transport's
syncs (None: it did not answer).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    from titan_core.accelerator.megatron_compat import import_megatron

    import_megatron()  # first, as the trainer and pretrain import it
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--transports", nargs="+", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--first-stage-layers", type=int, default=None)
    ap.add_argument("--bucket-bytes", type=int, default=64_000)
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--agents", nargs="*", default=[])
    ap.add_argument("--no-perturb", action="store_true")
    ap.add_argument("--syncs", type=int, default=1)
    ap.add_argument("--supervised", action="store_true")
    ap.add_argument("--no-check-before", action="store_true")
    a = ap.parse_args()

    from tests.sync.trainer_setup import hf_trainer_chunks, perturb
    from titan_core.parallel.initialize import shutdown
    from titan_rl.sync import SyncConfig, WeightSync, WeightSyncError

    chunks = hf_trainer_chunks(
        a.model_dir, tp=a.tp, pp=a.pp, ep=a.ep, vpp=a.vpp, first_stage_layers=a.first_stage_layers
    )
    results = []
    for i, given in enumerate(a.transports):
        transport = given.removesuffix("+supervised")
        supervised = a.supervised or given != transport
        name = transport.removesuffix("-direct")
        settings = {  # the chosen transport's section
            "tensor": {"format": "direct" if transport == "tensor-direct" else "flattened_bucket"},
            "disk": {"dir": a.disk_dir},
            "distributed": {},
            "mooncake": {"agents": a.agents},
        }[name]
        sc = SyncConfig(
            transport=name, bucket_bytes=a.bucket_bytes, check_every=1, strict=False,
            **{name: settings},
        )  # fmt: skip
        ws = WeightSync(sc, a.engines, a.model_dir, supervised=supervised)
        res: dict = {"transport": given, "rounds": []}
        for j in range(a.syncs):
            if not a.no_perturb:  # in place, as an optimizer step
                perturb(chunks, seed=100 + i + 1000 * j)
            version = f"v{i + 1}" if a.syncs == 1 else f"v{i + 1}.{j + 1}"
            rnd: dict = {
                "version": version,
                "before": {} if a.no_check_before else ws.check(chunks),
            }
            try:
                rnd["metrics"] = ws.sync(chunks, step=i + 1, version=version)
            except WeightSyncError as e:
                rnd["error"] = str(e)
                rnd["failed"] = sorted(e.failures)
            # HF bytes each trainer rank sent (rank order)
            rnd["rank_bytes"] = [None] * dist.get_world_size()
            dist.all_gather_object(rnd["rank_bytes"], ws.last_report.bytes)
            res["rounds"].append(rnd)
            if "error" in rnd:
                break
        # top level: the first sync's "before", the last one's outcome
        res.update({**res["rounds"][-1], "before": res["rounds"][0]["before"]})
        params = [p for chunk in chunks for p in chunk.parameters()]
        res["shared_params"] = all(p.is_shared() for p in params)
        if transport.startswith("tensor"):  # bytes copied into staging buffers
            staging = ws._transport.staging if ws._transport is not None else []
            res["staged_bytes"] = sum(s.buf.numel() for s in staging if s.buf is not None)
        ws.close()
        if dist.get_rank() == 0:
            res["engine_versions"] = {url: _weight_version(url) for url in a.engines}
        results.append(res)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(results, indent=1))
    shutdown()


def _weight_version(url: str) -> str | None:
    import httpx

    try:
        return httpx.get(f"{url}/get_model_info", timeout=10).json()["weight_version"]
    except httpx.HTTPError:
        return None


if __name__ == "__main__":
    main()
