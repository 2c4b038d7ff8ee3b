"""A TP worker process of the built-in engine (ranks 1..N-1; the server process is rank 0).

The worker loads the HF model, keeps its shard (:mod:`titan_rl.engine.tp.shard`), joins the
engine's gloo group on 127.0.0.1, then runs the commands rank 0 sends over its pipe, in
order, on its own :class:`~titan_rl.engine.runner.ModelRunner` (its shard and its KV cache):
the forwards meet rank 0's in their all-reduces. Weight updates are staged (each rank gets
its full tensors itself: its own ``/update_weights_from_tensor`` entry, the safetensors
files, or the trainer's broadcast), answered, then committed or discarded on every rank at
once. The worker exits when rank 0 says so, when its pipe closes, or when its parent dies.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from titan_rl.engine.mapped import MappedStorages
from titan_rl.engine.runner import ModelRunner, NamedTensors, build_runner, load_model
from titan_rl.engine.sampling import RequestError
from titan_rl.engine.tp.comm import GROUP_TIMEOUT, Comm, WorkerSpec, recv, send, tp_group
from titan_rl.engine.weights import (
    FromDisk,
    FromTensor,
    Source,
    check_finite,
    decode_tensor_payload,
    join_weight_update_group,
    load_safetensors_dir,
    receive_broadcast,
)
from titan_rl.wire.group import destroy_weights_update_group

log = logging.getLogger("titan_rl.engine.tp")

#: ops rank 0 may send that every rank runs on its runner, with no reply
RUNNER_OPS = frozenset(
    {"prefill", "keep_prefill", "decode", "select_rows", "reset", "release_weights",
     "resume_weights"}
)  # fmt: skip


class Worker:
    """This rank's runner, its weight-update groups and its staged update."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.groups: dict[str, Any] = {}
        self.staged: NamedTensors | None = None
        nbytes = runner.weight_bytes()
        self.mapped = MappedStorages(nbytes + nbytes // 2 + (1 << 30))

    def materialize(self, source: Source) -> NamedTensors:
        """This rank's full tensors of an update (checked against the checkpoint)."""
        if isinstance(source, FromTensor):
            named = decode_tensor_payload(source.payloads[0], source.load_format)
            self.mapped.add(named)
        elif isinstance(source, FromDisk):
            tensors = load_safetensors_dir(source.path)
            named = [(n, t) for n, t in tensors.items() if self.runner.knows(n)]
        else:
            pg = self.groups.get(source.group_name)
            if pg is None:
                raise RequestError(f"no weight update group {source.group_name!r} on this rank")
            named = receive_broadcast(
                pg, source.names, source.dtypes, source.shapes, source.load_format
            )
        self.runner.check(named)
        check_finite(named)  # this rank's entry (or read): rank 0 refuses the whole update
        return named

    # ---- ops with a reply (rank 0 waits for every rank's) ---------------------------------
    def stage(self, source: Source) -> None:
        self.staged = None
        self.staged = self.materialize(source)

    def commit(self, new_version: bool) -> int:
        staged, self.staged = self.staged or [], None
        n = self.runner.load(staged)
        if new_version:
            self.mapped.new_version()
        return n

    def join(self, *args: Any) -> None:
        name = args[4]
        self.groups[name] = join_weight_update_group(*args)

    def destroy(self, name: str) -> None:
        pg = self.groups.pop(name, None)
        if pg is not None:
            destroy_weights_update_group(pg)

    def shard(self, name: str) -> torch.Tensor:
        t = self.runner.tensor(name)
        if t is None:
            raise RequestError(f"unknown parameter {name!r}")
        return t.clone()

    def load(self, named: NamedTensors) -> int:
        return self.runner.load(named)

    # ---- ops without a reply ----------------------------------------------------------------
    def discard(self) -> None:
        self.staged = None


REPLY_OPS = frozenset({"stage", "commit", "join", "destroy", "shard", "load"})


def _watch_parent(parent: int) -> None:
    """Exit when the server process is gone (also after a kill -9 of it)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """Load this rank's shard, tell rank 0, form the group, then serve rank 0's commands."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(level="WARNING", format=f"%(asctime)s tp{spec.rank} %(message)s")
    torch.set_num_threads(spec.num_threads)
    torch.set_grad_enabled(False)
    comm = Comm()
    try:
        model = load_model(spec.model_path, spec.dtype)
        runner = build_runner(model, spec.rank, spec.size, comm, spec.model_impl)
    except Exception as e:
        send(conn, ("error", f"{type(e).__name__}: {e}"))
        return
    send(conn, ("ready", None))
    store = dist.TCPStore(
        "127.0.0.1", spec.store_port, spec.size, is_master=False, timeout=GROUP_TIMEOUT
    )
    comm.pg = tp_group(spec.rank, spec.size, store)
    worker = Worker(runner)
    _serve(conn, worker)


def _serve(conn: Connection, worker: Worker) -> None:
    """Run rank 0's commands until it says exit or goes away."""
    while True:
        try:
            op, args = recv(conn)
        except (EOFError, OSError):
            return  # rank 0 is gone
        if op == "exit":
            return
        with torch.inference_mode():
            if op in REPLY_OPS:
                try:
                    send(conn, ("ok", getattr(worker, op)(*args)))
                except RequestError as e:
                    send(conn, ("error", str(e)))
                except Exception as e:
                    log.exception("TP rank %d: %s failed", worker.runner.rank, op)
                    send(conn, ("error", f"{type(e).__name__}: {e}"))
                continue
            try:
                if op in RUNNER_OPS:
                    getattr(worker.runner, op)(*args)
                elif op == "discard":
                    worker.discard()
                else:
                    raise ValueError(f"unknown TP op {op!r}")
            except Exception:  # out of lockstep now: leave, rank 0 sees this rank gone
                log.exception("TP rank %d: %s failed; exiting", worker.runner.rank, op)
                os._exit(1)


def main(argv: list[str] | None = None) -> None:
    """``python -m titan_rl.engine.tp.worker --fd FD --spec JSON`` (started by rank 0)."""
    p = argparse.ArgumentParser(prog="python -m titan_rl.engine.tp.worker")
    p.add_argument("--fd", type=int, required=True, help="rank 0's command socket")
    p.add_argument("--spec", required=True, help="the WorkerSpec as JSON")
    args = p.parse_args(argv)
    worker_main(Connection(args.fd), WorkerSpec(**json.loads(args.spec)))


__all__ = ["Worker", "main", "worker_main"]


if __name__ == "__main__":
    # run the package's module, not this __main__ copy: commands unpickle to its classes
    from titan_rl.engine.tp.worker import main as package_main

    package_main()
