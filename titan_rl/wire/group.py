"""The weight-update process group, rendezvoused the way SGLang's engines do it.

SGLang's ``/init_weights_update_group`` joins a group outside the default one with
a ``tcp://`` rendezvous and torch's private ``_new_process_group_helper`` (as slime, verl, OpenRLHF
and vLLM do on the trainer side): a TCP store at ``tcp://master_address:master_port``
with the trainer as its master, a ``PrefixStore`` named after the group, then torch's own
per-group and per-device prefixes. The trainer and the built-in engine both call
:func:`init_weights_update_group`, so their store keys are SGLang's, and a Titan trainer
meets a real SGLang engine as it meets the built-in one.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

from titan_rl.wire.bucket import (
    NamedTensors,
    bucket_nbytes,
    flatten_named_tensors,
    parse_dtype,
    unflatten,
)


def init_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 120.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) a standalone process group of ``world_size`` members."""
    timeout = timedelta(seconds=timeout_s)
    # The store torch's tcp:// rendezvous makes, built directly: under torchrun that
    # rendezvous would join the agent's store instead of hosting one (rank 0 must host).
    store = dist.TCPStore(
        master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout
    )
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weights_update_group(pg: dist.ProcessGroup) -> None:
    """Leave a group made by :func:`init_weights_update_group` (its name can be reused)."""
    dist.destroy_process_group(pg)


def receive_broadcast(
    pg: dist.ProcessGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    load_format: str | None,
    device: torch.device | str = "cpu",
) -> NamedTensors:
    """Receive tensors broadcast from group rank 0, one by one or as one flattened uint8
    bucket, into fresh buffers on ``device`` (the one the group's backend reads: a GPU for
    NCCL/MCCL, never a CPU buffer there)."""
    empties = [
        (n, torch.empty(tuple(s), dtype=parse_dtype(d), device=device))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]
    if load_format == "flattened_bucket":
        flat = torch.empty(bucket_nbytes(empties), dtype=torch.uint8, device=device)
        pg.broadcast(flat, 0).wait()
        meta, offset = [], 0
        for n, t in empties:
            size = t.numel() * t.element_size()
            meta.append((n, t.shape, t.dtype, offset, offset + size))
            offset += size
        return unflatten(flat, meta)
    for _, t in empties:
        pg.broadcast(t, 0).wait()
    return empties


def broadcast_named_tensors(
    pg: dist.ProcessGroup, named: NamedTensors, load_format: str | None = None
) -> None:
    """The sender's side (group rank 0) of :func:`receive_broadcast`: same order and layout."""
    if load_format == "flattened_bucket":
        flat, _ = flatten_named_tensors(named)
        pg.broadcast(flat, 0).wait()
        return
    for _, t in named:
        pg.broadcast(t.detach().contiguous(), 0).wait()
