"""Rank 0's side of the built-in engine's tensor parallelism (``--tp-size N``).

The server process is TP rank 0: it starts N-1 worker processes (:mod:`titan_rl.engine.tp_worker`)
and forms a gloo group with them on 127.0.0.1, whose only traffic is the model's all-reduces.
Every operation that touches the model is sent to the workers as one small command over their
pipes (in order, from the engine thread only) before rank 0 runs it on its own shard, so all
ranks run the same forwards and keep the same KV-cache rows. Sampling happens on rank 0 alone:
the logits are whole on every rank. Weight updates are staged on every rank, then committed
only if all ranks staged them; a worker that dies makes the engine unhealthy (``/health`` 503).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_core.tied_child import popen_tied
from titan_rl.engine.runner import ModelRunner, NamedTensors
from titan_rl.engine.sampling import RequestError
from titan_rl.engine.tp_comm import GROUP_TIMEOUT, Comm, WorkerSpec, recv, send, tp_group
from titan_rl.engine.tp_sources import Source

log = logging.getLogger("titan_rl.engine.tp")

#: the directory holding the titan_rl package (the workers import it from there)
_ROOT = str(Path(__file__).resolve().parents[2])
#: seconds between liveness checks of a worker while waiting for its answer
_POLL_S = 0.5


class TPError(RuntimeError):
    """A worker died or the ranks fell out of lockstep: the engine cannot serve any more."""


class TPLeader:
    """The workers of one engine, seen from rank 0: start-up, commands, answers, shutdown."""

    def __init__(self, model_path: str, dtype: str, size: int, threads: int) -> None:
        self.size = size
        self.broken: str | None = None
        self.runner: ModelRunner | None = None
        self._store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
        )
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            spec = WorkerSpec(model_path, dtype, rank, size, self._store.port, threads)
            self._start(spec)

    def _start(self, spec: WorkerSpec) -> None:
        """Start one worker as ``python -m titan_rl.engine.tp_worker`` (a fresh interpreter:
        no dependence on the caller's main module), with one end of a socket pair."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([_ROOT, *paths])
        cmd = [sys.executable, "-m", "titan_rl.engine.tp_worker", "--fd", str(theirs.fileno())]
        cmd += ["--spec", json.dumps(dataclasses.asdict(spec))]
        with theirs:  # SIGKILLed if this server dies (it also watches: tp_worker._watch_parent)
            proc = popen_tied(cmd, pass_fds=[theirs.fileno()], env=env)
        self._conns.append(Connection(ours.detach()))
        self._procs.append(proc)

    def connect(self, runner: ModelRunner, comm: Comm) -> None:
        """Wait until every worker has loaded its shard, then form the group with them
        (ValueError with the worker's error if one failed to start)."""
        for k in range(len(self._procs)):
            status, message = self._answer(k, starting=True)
            if status != "ready":
                raise ValueError(f"engine TP rank {k + 1} failed to start: {message}")
        comm.pg = tp_group(0, self.size, self._store)
        self.runner = runner

    @property
    def alive(self) -> bool:
        return self.broken is None and all(p.poll() is None for p in self._procs)

    # ---- commands ---------------------------------------------------------------------------
    def send(self, op: str, *args: Any) -> None:
        """Send one command to every worker."""
        self.send_each(op, [args] * len(self._conns))

    def send_each(self, op: str, args: list[tuple[Any, ...]]) -> None:
        """Send ``op`` to every worker, worker k (TP rank k + 1) with ``args[k]``."""
        if self.broken is not None:
            raise TPError(f"the engine's TP ranks are out of service: {self.broken}")
        for k, (conn, a) in enumerate(zip(self._conns, args, strict=True)):
            try:
                send(conn, (op, a))
            except OSError as e:
                self.broken = f"TP rank {k + 1} is gone ({type(e).__name__}: {e})"
                raise TPError(self.broken) from None

    def _answer(self, k: int, starting: bool = False) -> tuple[str, Any]:
        conn, proc = self._conns[k], self._procs[k]
        while not conn.poll(_POLL_S):
            if proc.poll() is not None:
                why = f"TP rank {k + 1} exited with code {proc.returncode}"
                if starting:
                    return "error", why
                self.broken = why
                raise TPError(why)
        try:
            return recv(conn)
        except (EOFError, OSError) as e:
            self.broken = f"TP rank {k + 1} is gone ({type(e).__name__})"
            raise TPError(self.broken) from None

    def answers(self) -> list[tuple[str, Any]]:
        """Every worker's answer to the last command (``("ok", value)`` or ``("error", msg)``)."""
        return [self._answer(k) for k in range(len(self._conns))]

    def fail(self, why: str) -> None:
        """Rank 0 failed inside a command the workers ran: the ranks are out of lockstep."""
        self.broken = why

    # ---- weights ------------------------------------------------------------------------------
    def _local(self) -> ModelRunner:
        assert self.runner is not None, "connect() first"
        return self.runner

    def update(self, source: Source, own: Callable[[], NamedTensors], new_version: bool) -> int:
        """Stage an update on every rank (rank 0's tensors from ``own``, each worker's from
        ``source``), then commit it everywhere, or nowhere if a rank refused it."""
        self.send_each("stage", [(source.for_rank(k + 1),) for k in range(len(self._conns))])
        mine: Exception | None = None
        named: NamedTensors = []
        try:
            named = own()
            self._local().check(named)
        except Exception as e:  # answered below, once every rank has staged (or refused)
            mine = e
        theirs = [(k + 1, v) for k, (status, v) in enumerate(self.answers()) if status != "ok"]
        if mine is not None or theirs:
            self.send("discard")
            if mine is not None:
                raise mine
            raise RequestError("; ".join(f"engine TP rank {r}: {msg}" for r, msg in theirs))
        self.send("commit", new_version)
        n = self._local().load(named)
        self._expect_ok("commit")
        return n

    def load(self, named: NamedTensors) -> int:
        """Load full tensors on every rank (they travel pickled through the pipes)."""
        self._local().check(named)
        self.send("load", named)
        n = self._local().load(named)
        self._expect_ok("load")
        return n

    def _expect_ok(self, op: str) -> list[Any]:
        values = []
        for k, (status, value) in enumerate(self.answers()):
            if status != "ok":
                self.broken = f"TP rank {k + 1} failed to {op} after staging: {value}"
                raise TPError(self.broken)
            values.append(value)
        return values

    def full_tensor(self, name: str) -> torch.Tensor | None:
        """The whole checkpoint tensor ``name``, put together from every rank's shard."""
        local = self._local()
        mine = local.tensor(name)
        split = local.splits.get(name)
        if mine is None or split is None:
            return mine
        self.send("shard", name)
        return split.join([mine, *self._expect_ok("shard")])

    # ---- weight-update groups -----------------------------------------------------------------
    def join_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> Any:
        """Every rank k joins the trainer's group as ``rank_offset + k``; rank 0's group."""
        from titan_rl.engine.weights import join_weight_update_group

        if rank_offset < 0 or rank_offset + self.size > world_size:
            raise RequestError(
                f"rank_offset {rank_offset} + tp_size {self.size} exceeds world_size "
                f"{world_size}: every engine TP rank joins the group (as rank_offset + k)"
            )
        args = (master_address, master_port, rank_offset, world_size, group_name, backend)
        self.send_each(
            "join", [(*args[:2], rank_offset + k + 1, *args[3:]) for k in range(self.size - 1)]
        )
        pg, mine = None, None
        try:
            pg = join_weight_update_group(*args)
        except Exception as e:
            mine = str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
        answers = self.answers()
        failed = [(k + 1, v) for k, (status, v) in enumerate(answers) if status != "ok"]
        if mine is None and not failed:
            return pg
        joined = [k for k, (status, _) in enumerate(answers) if status == "ok"]
        if joined:
            self.send_each("destroy", [(group_name,)] * len(self._conns))
            self.answers()
        if pg is not None:
            from titan_rl.wire.group import destroy_weights_update_group

            destroy_weights_update_group(pg)
        errors = ([f"engine TP rank 0: {mine}"] if mine else []) + [
            f"engine TP rank {r}: {msg}" for r, msg in failed
        ]
        raise RequestError("could not join the weight update group: " + "; ".join(errors))

    def destroy_group(self, group_name: str) -> None:
        self.send("destroy", group_name)
        self._expect_ok("destroy")

    # ---- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (asked first, then terminated)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                send(conn, ("exit", ()))
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(timeout=5)
        for conn in self._conns:
            conn.close()
        self.broken = self.broken or "closed"


__all__ = ["TPError", "TPLeader"]
