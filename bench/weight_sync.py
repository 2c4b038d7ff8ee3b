"""Weight sync bandwidth per transport against this machine's memcpy, measured in one run.

    python bench/weight_sync.py                      # ~134M-parameter Qwen3, fp32, all transports
    python bench/weight_sync.py --transports tensor tensor-direct --bucket-mib 512

A real megatron-core trainer (this process, TP=1) loads a random HF Qwen3 and pushes it to a
real built-in engine server (``python -m titan_rl.engine``) with :class:`WeightSync`; GB/s is
HF bytes / wall time of the whole transfer (export + send + engine load, pause/flush and version
bump excluded). memcpy is a plain ``Tensor.copy_`` of one bucket-sized buffer with torch's
default threads (all cores); the engine gets the same thread count, so its load copies with
what the anchor copies with (a real engine has its whole device to itself). Each transport
runs ``--repeats`` times; the best run is reported (the first also pays one-off set-up).
``tensor`` sends flattened buckets (sync.tensor.format=flattened_bucket), ``tensor-direct`` the
parameters themselves (sync.tensor.format=direct).

Trainer layouts (issue 18: no funnel through trainer rank 0):

    python bench/weight_sync.py --trainer-layout pp=2 pp=2,ep=2 tp=2 --transports tensor distributed

runs, per layout, a torchrun trainer of ``tp * pp * ep`` ranks (a dense Qwen3, or a Qwen3-MoE
whose experts hold most of the weights when the layout has ``ep``) syncing into ``--engines``
built-in engines of ``--engine-tp`` ranks each, and prints per layout x transport the max
bytes one trainer rank sent / the model's bytes (the old design's rank 0 sent all: 1.0; goals
PP=2 <= 0.55, PP=2 x EP=2 <= 0.35), the sync's wall time (sync/time_s, sync/transfer_s) and
the parity after it (check every sync; < 1e-4). The single-rank figures are not run then.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weight_sync_layouts import Layout, parse_layout  # noqa: E402 (bench/, beside this file)
from weight_sync_worker import trainer_chunks  # noqa: E402


def build_model(path: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--transports",
        nargs="+",
        default=["tensor", "tensor-direct", "distributed", "disk", "mooncake"],
    )
    ap.add_argument(
        "--trainer-layout",
        nargs="+",
        action="extend",
        type=_layout,
        default=[],
        metavar="LAYOUT",
        help="trainer layouts to sync from, e.g. pp=2 tp=2 pp=2,ep=2 (keys tp, pp, ep, vpp)",
    )
    ap.add_argument("--engines", type=int, default=2, help="engines per layout (default 2)")
    ap.add_argument("--engine-tp", type=int, default=1, choices=[1, 2], help="TP of each engine")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.repeats < 1 or a.engines < 1:
        ap.error("--repeats and --engines must be at least 1")
    if a.trainer_layout:
        from weight_sync_multirank import run_layouts

        tmp = Path(tempfile.mkdtemp(prefix="titan-bench-sync-layouts-"))
        layouts = list(dict.fromkeys(a.trainer_layout))  # each once, in the order given
        run_layouts(
            layouts, a.transports, a.engines, a.engine_tp, tmp, a.bucket_mib << 20, a.repeats
        )
        return

    from titan_core.net import free_port
    from titan_core.parallel.initialize import shutdown
    from titan_rl.actors.config import EngineServerConfig
    from titan_rl.actors.server import ServerProcess
    from titan_rl.sync import SyncConfig, WeightSync

    tmp = Path(tempfile.mkdtemp(prefix="titan-bench-sync-"))
    n_params = build_model(tmp / "model", a.hidden, a.layers, a.vocab)
    print(f"model: Qwen3 {n_params / 1e6:.1f}M parameters, fp32 ({n_params * 4 / 2**20:.0f} MiB)")
    if n_params < 100e6:
        print("warning: below 100M parameters; raise --hidden/--layers for a representative run")

    chunks = trainer_chunks(str(tmp / "model"))

    bucket = a.bucket_mib << 20
    memcpy = memcpy_gbps(bucket)
    print(f"memcpy: {memcpy:.2f} GB/s ({a.bucket_mib} MiB copy_)")

    engine = ServerProcess(
        EngineServerConfig(
            model_path=str(tmp / "model"), backend="builtin", num_threads=torch.get_num_threads(),
            log_dir=str(tmp / "logs"), startup_timeout_s=300,
        ),
        name="bench-engine",
    )  # fmt: skip
    engine.start()
    agent = None
    rows = []
    try:
        for transport in a.transports:
            extra: dict = {}
            if transport == "mooncake":
                if importlib.util.find_spec("mooncake") is None:
                    print("mooncake: skipped (pip install mooncake-transfer-engine-non-cuda)")
                    continue
                port = free_port()
                agent = subprocess.Popen(
                    [sys.executable, "-m", "titan_rl.sync.mooncake_agent", "--engine-url",
                     engine.url, "--port", str(port), "--buffer-bytes", str(bucket)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                extra["mooncake"] = {"agents": [f"http://127.0.0.1:{port}"]}
                _wait_http(f"http://127.0.0.1:{port}/info", agent)
            if transport == "tensor-direct":
                extra["tensor"] = {"format": "direct"}
            if transport == "disk":
                extra["disk"] = {"dir": str(tmp / "disk")}
            sc = SyncConfig(
                transport=transport.removesuffix("-direct"), bucket_bytes=bucket, check_every=0,
                **extra,
            )  # fmt: skip
            ws = WeightSync(sc, [engine.url], tmp / "model")
            best: dict = {}
            for i in range(a.repeats):
                m = ws.sync(chunks, step=i + 1, version=f"{transport}-{i + 1}")
                if not best or m["sync/transfer_s"] < best["sync/transfer_s"]:
                    best = m
            ws.close()
            gbps = best["sync/gbps"]
            rows.append((transport, best["sync/bytes"], best["sync/transfer_s"], gbps))
            print(
                f"{transport:>13}: {best['sync/bytes'] / 2**20:.0f} MiB in "
                f"{best['sync/transfer_s']:.2f} s = {gbps:.3f} GB/s, {gbps / memcpy:.3f} x memcpy",
                flush=True,
            )
            if agent is not None:
                agent.terminate()
                agent.wait(10)
                agent = None
    finally:
        if agent is not None:
            agent.terminate()
        engine.stop()
        shutdown()
    print("\ntransport      GB/s    ratio to memcpy")
    for t, _, _, g in rows:
        print(f"{t:<14} {g:6.3f}  {g / memcpy:.3f}")
    tensor = {t: g / memcpy for t, _, _, g in rows if t in ("tensor", "tensor-direct")}
    if tensor:
        met = [t for t, r in tensor.items() if r >= 0.5]
        ratios = ", ".join(f"{t} {r:.3f}" for t, r in tensor.items())
        verdict = f"met by {' and '.join(met)}" if met else "NOT met"
        print(f"goal tensor >= 0.5 x memcpy: {verdict} ({ratios})")


def _layout(text: str) -> Layout:
    try:
        return parse_layout(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _wait_http(url: str, proc: subprocess.Popen) -> None:
    import httpx

    for _ in range(200):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer")


if __name__ == "__main__":
    main()
