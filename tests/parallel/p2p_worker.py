"""Two ranks (stage 0, stage 1) drive MooncakeP2PCommunicator through megatron-core's
P2PCommunicator interface; each rank writes what it saw to ``<out>/rank<r>.json``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 p2p_worker.py OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titan_core.accelerator.megatron_compat import import_megatron

import_megatron()  # first, as the trainer and pretrain import it
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402

from titan_core.parallel.p2p_channels import P2PTransferError  # noqa: E402
from titan_core.parallel.p2p_mooncake import SLOTS, MooncakeP2PCommunicator  # noqa: E402

SHAPE = (8, 2, 16)  # 1 KiB in fp32: four times the 256-byte initial capacity


def tensor(tag: int, shape=SHAPE, dtype=torch.float32) -> torch.Tensor:  # noqa: ANN001
    g = torch.Generator().manual_seed(tag)
    return torch.randn(shape, generator=g).to(dtype)


def make(timeout_s: float = 60.0, capacity: int = 256, **cfg) -> MooncakeP2PCommunicator:  # noqa: ANN003
    config = ModelParallelConfig(
        pipeline_dtype=cfg.pop("dtype", torch.float32), pipeline_model_parallel_size=2, **cfg
    )
    return MooncakeP2PCommunicator(
        dist.group.WORLD, config, host="127.0.0.1", timeout_s=timeout_s, capacity_bytes=capacity,
        device=torch.device("cpu"),
    )  # fmt: skip


def one_f_one_b(comm: MooncakeP2PCommunicator, rank: int, n: int) -> dict:
    """Forward activations 0 -> 1, gradients 1 -> 0, in 1F1B's combined calls."""
    ok = []
    if rank == 0:
        comm.send_forward(tensor(0), is_last_stage=False)
        for i in range(1, n):
            g = comm.send_forward_recv_backward(tensor(i), SHAPE, is_last_stage=False)
            ok.append(torch.equal(g, tensor(1000 + i - 1)))
        g = comm.recv_backward(SHAPE, is_last_stage=False)
        ok.append(torch.equal(g, tensor(1000 + n - 1)))
    else:
        x = comm.recv_forward(SHAPE, is_first_stage=False)
        for i in range(n):
            ok.append(torch.equal(x, tensor(i)) and x.requires_grad)
            if i < n - 1:
                x = comm.send_backward_recv_forward(tensor(1000 + i), SHAPE, is_first_stage=False)
            else:
                comm.send_backward(tensor(1000 + i), is_first_stage=False)
    return {
        "all_equal": all(ok),
        "count": len(ok),
        "ring_grows": comm.from_prev.grows + comm.from_next.grows,
        "staging_grows": comm.to_next.grows + comm.to_prev.grows,
    }


def overlapped(comm: MooncakeP2PCommunicator, rank: int, n: int) -> dict:
    """VPP's overlap_p2p_comm: both ranks send next and receive prev (the ring wraps at
    PP=2); receives are deferred to handles, waited here newest first."""
    got, handles = [], []
    for i in range(n):
        t, h = comm.send_forward_recv_forward(
            tensor(10 * rank + i), recv_prev=True, tensor_shape=SHAPE, overlap_p2p_comm=True
        )
        got.append(t)
        handles.append(h)
    for h in reversed(handles):
        h["send_next"].wait()
        h["recv_prev"].wait()
    peer = 1 - rank
    return {"all_equal": all(torch.equal(t, tensor(10 * peer + i)) for i, t in enumerate(got))}


def variable(comm: MooncakeP2PCommunicator, rank: int) -> dict:
    """variable_seq_lengths: the receiver learns each shape from the trailer (bf16)."""
    shapes = [(3, 2, 4), (40, 2, 4), (5, 1, 4)]
    if rank == 0:
        for i, s in enumerate(shapes):
            comm.send_forward(tensor(i, s, torch.bfloat16), is_last_stage=False)
        return {}
    # megatron passes its nominal shape; the sent shape wins (as after _communicate_shapes)
    got = [comm.recv_forward(SHAPE, is_first_stage=False) for _ in shapes]
    return {
        "shapes": [list(t.shape) for t in got],
        "all_equal": all(
            torch.equal(t, tensor(i, s, torch.bfloat16))
            for i, (t, s) in enumerate(zip(got, shapes, strict=True))
        ),
        "dtypes": sorted({str(t.dtype) for t in got}),
    }


def mismatch(comm: MooncakeP2PCommunicator, rank: int) -> dict:
    if rank == 0:
        comm.send_forward(tensor(0, (4, 2, 16)), is_last_stage=False)
        return {}
    try:
        comm.recv_forward(SHAPE, is_first_stage=False)
    except P2PTransferError as e:
        return {"error": str(e)}
    return {"error": None}


def silent_peer(comm: MooncakeP2PCommunicator, rank: int) -> dict:
    """Stage 0 keeps sending, stage 1 never receives; stage 1 waits for a gradient stage 0
    never sends. Both must fail within the timeout, naming the other stage."""
    start = time.monotonic()
    try:
        if rank == 0:
            for i in range(4 * SLOTS):
                comm.send_forward(tensor(i), is_last_stage=False)
            comm.to_next.drain(time.monotonic() + comm.timeout_s)
        else:
            comm.recv_backward(SHAPE, is_last_stage=False)
    except P2PTransferError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    res["1f1b"] = one_f_one_b(make(), rank, n=3 * SLOTS)
    res["overlap"] = overlapped(make(), rank, n=SLOTS + 2)
    res["variable"] = variable(make(variable_seq_lengths=True, dtype=torch.bfloat16), rank)
    res["mismatch"] = mismatch(make(), rank)
    dist.barrier()
    res["silent"] = silent_peer(make(timeout_s=1.5, capacity=4096), rank)
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
