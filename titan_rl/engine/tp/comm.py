"""What the built-in engine's TP ranks share: the worker's start spec, the gloo group the
model's all-reduces run on (127.0.0.1), and the framing of rank 0's commands on the pipes."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from titan_rl.engine_settings import ModelImpl

#: how long a TP rank waits for the others to form the group or to join an all-reduce
GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start: the model, its rank, and rank 0's group store."""

    model_path: str
    dtype: str
    rank: int
    size: int
    store_port: int
    num_threads: int
    #: ``--model-impl``
    model_impl: ModelImpl = "auto"


class Comm:
    """Sums a rank's partial outputs over the engine's TP group (set once it is formed)."""

    def __init__(self) -> None:
        self.pg: Any = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self.pg.allreduce([t]).wait()
        return t


def tp_group(rank: int, size: int, store: dist.Store) -> Any:
    """The engine's own gloo group over ``store`` (hosted by rank 0 on 127.0.0.1)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = GROUP_TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("titan-engine-tp", store), rank, size, opts)


def threads_per_rank(num_threads: int | None, size: int) -> int:
    """The torch threads of each rank: ``num_threads`` (default: torch's) shared by ``size``."""
    return max(1, (num_threads or torch.get_num_threads()) // size)


def send(conn: Connection, obj: Any) -> None:
    """One command or answer on a rank's pipe (pickled: the peers are this engine's own
    processes, never a client)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    """The next command or answer sent with :func:`send` (blocks)."""
    return pickle.loads(conn.recv_bytes())


__all__ = [
    "GROUP_TIMEOUT",
    "Comm",
    "WorkerSpec",
    "recv",
    "send",
    "threads_per_rank",
    "tp_group",
]
