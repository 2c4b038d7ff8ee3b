"""The weight-update group meets a peer that joins the way SGLang's engines do (torch's
``tcp://`` rendezvous, a PrefixStore named after the group, ``_new_process_group_helper``),
and a destroyed group's name can be joined again."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import torch

from titan_core.net import free_port
from titan_rl.wire.group import destroy_weights_update_group, init_weights_update_group


def _sglang_style_join(port: int, group: str) -> torch.distributed.ProcessGroup:
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=30)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    pg, _ = _new_process_group_helper(
        world, rank, [], "gloo", PrefixStore(group, store), group_name=group, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    return pg


def _member(rank: int, ports: list[int], out: mp.Queue) -> None:
    got = []
    for i, port in enumerate(ports):
        if rank == 0:
            pg = init_weights_update_group("127.0.0.1", port, 0, 2, "weight-update-0", "gloo", 30)
        else:
            pg = _sglang_style_join(port, "weight-update-0")
        t = torch.arange(6.0) * (i + 1) if rank == 0 else torch.zeros(6)
        pg.broadcast(t, 0).wait()
        got.append(t.tolist())
        destroy_weights_update_group(pg)
    out.put((rank, got))


def test_trainer_meets_an_sglang_style_peer_twice():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port(), free_port()]
    procs = [ctx.Process(target=_member, args=(r, ports, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0]
    results = dict(out.get(timeout=5) for _ in procs)
    expected = [[float(x) for x in range(6)], [2.0 * x for x in range(6)]]
    assert results[0] == results[1] == expected
