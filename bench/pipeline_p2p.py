"""Pipeline P2P: Mooncake TransferEngine (TCP) against torch.distributed (gloo) on loopback.

    python bench/pipeline_p2p.py                          # ~70 s on 2 CPU cores (4.5 min under load)
    python bench/pipeline_p2p.py --sizes-kib 64 1024 --steps 10 --layouts 1f1b

1. Stage-to-stage bytes/s: two processes (stage 0 -> stage 1), ``--reps`` messages per size,
   timed on the receiver from a barrier to the last message landed. Mooncake goes through
   Titan's own channels (``titan_core/parallel/p2p_channels.py``: registered ring, credits,
   background sender), exactly what ``parallel.p2p_transport=mooncake`` sends with; torch is
   ``dist.send``/``dist.recv`` over gloo.
2. PP=2 step time: ``python -m titan_core.pretrain`` (examples/pretrain_tiny.yaml, fp32) run
   with each transport, 1F1B and VPP=2; median ``step_time_s`` over steps 2.. (step 1 pays
   set-up). Losses are checked equal between the transports.

Ratios are Mooncake / torch (bytes/s: > 1 is Mooncake faster; step time: < 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_core.net import free_port  # noqa: E402

LAYOUTS = {
    "1f1b": ["parallel.pipeline_model_parallel_size=2"],
    "vpp": [
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
    ],
}


def _bandwidth_worker(rank: int, port: int, sizes: list[int], reps: int, out: str) -> None:
    from titan_core.parallel.p2p_channels import Endpoint, RecvChannel, SendChannel
    from titan_core.parallel.p2p_mooncake import SLOTS

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = dist.distributed_c10d._get_default_store()
    ep = Endpoint("127.0.0.1", timeout_s=120)
    if rank == 0:
        ch = SendChannel(ep, "stage 1", SLOTS, max(sizes), store, "bench/p2p")
        mine = {"session": ep.session, "credit": ch.credit_addr}
    else:
        ch = RecvChannel(ep, "stage 0", SLOTS, max(sizes), store, "bench/p2p")
        mine = {"ring": ch.info()}
    both: list = [None, None]
    dist.all_gather_object(both, mine)
    if rank == 0:
        ch.connect(both[1]["ring"])
    else:
        ch.connect(both[0]["session"], both[0]["credit"])
    ep.start()
    rows = []
    for size in sizes:
        # the same tensor on both ranks: the receiver checks every byte arrived
        t = torch.randn(size // 4, generator=torch.Generator().manual_seed(size))
        buf = torch.empty_like(t)
        n = max(8, min(reps, (256 << 20) // size))
        rates = {}
        for name in ("torch", "mooncake"):
            dist.barrier()
            start = time.perf_counter()
            deadline = time.monotonic() + 120
            for _ in range(n):
                if name == "torch":
                    dist.send(t, 1) if rank == 0 else dist.recv(buf, 0)
                elif rank == 0:
                    ch.post(t, deadline)
                else:
                    ch.recv(lambda _s, b=buf: b, deadline)
            if rank == 0 and name == "mooncake":
                ch.drain(deadline)
            rates[name] = n * size / (time.perf_counter() - start)
            if rank == 1:
                assert torch.equal(buf, t), f"{name}: wrong bytes at {size}"
        rows.append({"bytes": size, "messages": n, **rates})
    dist.barrier()
    if rank == 1:
        Path(out).write_text(json.dumps(rows))
    ep.close()
    dist.destroy_process_group()


def bandwidth(sizes: list[int], reps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bw.json")
        mp.spawn(_bandwidth_worker, args=(free_port(), sizes, reps, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def step_time(transport: str, layout: str, steps: int, run_dir: Path) -> tuple[float, list]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "titan_core.pretrain", "--config", str(REPO / "examples/pretrain_tiny.yaml"),
        "train.micro_batch_size=8", "train.global_batch_size=64", f"train.train_iters={steps}",
        "train.lr_warmup_iters=1", "checkpoint.save_interval=0", "data.num_samples=20000",
        f"parallel.p2p_transport={transport}", "parallel.p2p_mooncake_host=127.0.0.1",
        f"run.dir={run_dir}", *LAYOUTS[layout],
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in recs[1:]]
    return statistics.median(times), [r["loss"] for r in recs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024, 16384])
    ap.add_argument("--reps", type=int, default=200, help="messages per size (at most 256 MiB)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["1f1b", "vpp"])
    args = ap.parse_args(argv)

    print("stage-to-stage bytes/s, stage 0 -> stage 1 on 127.0.0.1")
    print(f"{'message':>10} {'msgs':>5} {'gloo MB/s':>10} {'mooncake MB/s':>14} {'ratio':>6}")
    for r in bandwidth([k << 10 for k in args.sizes_kib], args.reps):
        ratio = r["mooncake"] / r["torch"]
        print(
            f"{r['bytes'] >> 10:>7} KiB {r['messages']:>5} {r['torch'] / 1e6:>10.1f} "
            f"{r['mooncake'] / 1e6:>14.1f} {ratio:>6.2f}"
        )
    print(f"\nPP=2 pretraining step time (examples/pretrain_tiny.yaml, fp32, {args.steps} steps,")
    print("8 microbatches of 8 x 128 tokens: 512 KiB activations), median over steps 2..")
    print(f"{'layout':>6} {'torch s':>8} {'mooncake s':>11} {'ratio':>6}  losses equal")
    with tempfile.TemporaryDirectory() as d:
        for layout in args.layouts:
            got = {
                t: step_time(t, layout, args.steps, Path(d) / f"{layout}-{t}")
                for t in ("torch", "mooncake")
            }
            (ts, tl), (ms, ml) = got["torch"], got["mooncake"]
            print(f"{layout:>6} {ts:>8.3f} {ms:>11.3f} {ms / ts:>6.2f}  {tl == ml}")


if __name__ == "__main__":
    main()
