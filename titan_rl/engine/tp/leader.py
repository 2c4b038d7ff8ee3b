"""Rank 0's side of the built-in engine's tensor parallelism (``--tp-size N``), and the runner
the engine gets at any ``tp_size`` (:func:`start_runner`).

The server process is TP rank 0: it starts N-1 worker processes (:mod:`titan_rl.engine.tp.worker`)
and forms a gloo group with them on 127.0.0.1, whose only traffic is the model's all-reduces.
:class:`TPRunner` is rank 0's :class:`~titan_rl.engine.runner.Runner`: every operation that
touches the model is sent to the workers as one small command over their pipes (in order, from
the engine thread only) before rank 0 runs it on its own shard, so all ranks run the same
forwards and keep the same KV-cache rows. Sampling happens on rank 0 alone: the logits are whole
on every rank. Weight updates are staged on every rank, then committed only if all ranks staged
them; a worker that dies makes the engine unhealthy (``/health`` 503).
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
from titan_rl.engine.routing import RoutingRecorder
from titan_rl.engine.runner import ModelRunner, NamedTensors, Runner, build_runner, load_model
from titan_rl.engine.sampling import RequestError
from titan_rl.engine.tp.comm import GROUP_TIMEOUT, Comm, WorkerSpec, recv, send, tp_group
from titan_rl.engine.weights import Source, join_weight_update_group
from titan_rl.engine_settings import ModelImpl
from titan_rl.wire.group import destroy_weights_update_group

log = logging.getLogger("titan_rl.engine.tp")

#: the directory holding the titan_rl package (the workers import it from there)
_ROOT = str(Path(__file__).resolve().parents[3])
#: seconds between liveness checks of a worker while waiting for its answer
_POLL_S = 0.5


class TPError(RuntimeError):
    """A worker died or the ranks fell out of lockstep: the engine cannot serve any more."""


def start_runner(
    model_path: str, dtype: str, tp_size: int, threads: int, model_impl: ModelImpl = "auto"
) -> Runner:
    """The engine's runner: this process's :class:`ModelRunner` at ``tp_size`` 1; else the N-1
    workers are started (each loads its shard while this rank loads its own), then rank 0's
    :class:`TPRunner` over them. ``threads``: each worker's torch threads."""
    if tp_size == 1:
        return build_runner(load_model(model_path, dtype), 0, 1, Comm(), model_impl)
    workers = Workers(model_path, dtype, tp_size, threads, model_impl)
    try:
        comm = Comm()
        local = build_runner(load_model(model_path, dtype), 0, tp_size, comm, model_impl)
        workers.connect(comm)
    except BaseException:
        workers.close()
        raise
    return TPRunner(local, workers)


class Workers:
    """The worker processes of one engine (ranks 1..N-1), seen from rank 0: start-up,
    commands, answers, shutdown."""

    def __init__(
        self, model_path: str, dtype: str, size: int, threads: int, model_impl: ModelImpl = "auto"
    ) -> None:
        self.size = size
        self.broken: str | None = None
        self._store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
        )
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            spec = WorkerSpec(model_path, dtype, rank, size, self._store.port, threads, model_impl)
            self._start(spec)

    def _start(self, spec: WorkerSpec) -> None:
        """Start one worker as ``python -m titan_rl.engine.tp.worker`` (a fresh interpreter:
        no dependence on the caller's main module), with one end of a socket pair."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([_ROOT, *paths])
        cmd = [sys.executable, "-m", "titan_rl.engine.tp.worker", "--fd", str(theirs.fileno())]
        cmd += ["--spec", json.dumps(dataclasses.asdict(spec))]
        with theirs:  # SIGKILLed if this server dies (it also watches: worker._watch_parent)
            proc = popen_tied(cmd, pass_fds=[theirs.fileno()], env=env)
        self._conns.append(Connection(ours.detach()))
        self._procs.append(proc)

    def connect(self, comm: Comm) -> None:
        """Wait until every worker has loaded its shard, then form the group with them
        (ValueError with the worker's error if one failed to start)."""
        for k in range(len(self._procs)):
            status, message = self._answer(k, starting=True)
            if status != "ready":
                raise ValueError(f"engine TP rank {k + 1} failed to start: {message}")
        comm.pg = tp_group(0, self.size, self._store)

    @property
    def alive(self) -> bool:
        return self.broken is None and all(p.poll() is None for p in self._procs)

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

    def expect_ok(self, op: str) -> list[Any]:
        """Every worker's value for ``op``; one that failed breaks the engine (TPError)."""
        values = []
        for k, (status, value) in enumerate(self.answers()):
            if status != "ok":
                self.broken = f"TP rank {k + 1} failed to {op} after staging: {value}"
                raise TPError(self.broken)
            values.append(value)
        return values

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


class TPRunner:
    """Rank 0's :class:`~titan_rl.engine.runner.Runner`: its own shard (``local``) and the
    workers, every operation on the workers first, then here."""

    def __init__(self, local: ModelRunner, workers: Workers) -> None:
        self.local = local
        self.workers = workers
        self.size = workers.size
        self.model: torch.nn.Module = local.model
        self.routing: RoutingRecorder = local.routing

    @property
    def alive(self) -> bool:
        return self.workers.alive

    def _lockstep(
        self, op: str, args: tuple[Any, ...], workers: tuple[Any, ...] | None = None
    ) -> Any:
        """Run runner operation ``op`` on the workers (with ``workers`` as their arguments
        where given), then here."""
        self.workers.send(op, *(args if workers is None else workers))
        try:
            return getattr(self.local, op)(*args)
        except BaseException as e:  # the workers ran it: the ranks no longer agree
            self.workers.broken = f"rank 0 failed in {op}: {type(e).__name__}: {e}"
            raise

    # ---- forwards ----------------------------------------------------------------------------
    def prefill(
        self,
        key: int,
        ids: torch.Tensor,
        total: int,
        logits_to_keep: int,
        record: bool,
        rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the workers' logits and routing are not used: they compute only the last position's
        args = (key, ids, total, logits_to_keep, record, rows)
        return self._lockstep("prefill", args, (key, ids, total, 1, False, rows))

    def keep_prefill(self, key: int, rows: list[int]) -> None:
        self._lockstep("keep_prefill", (key, rows))

    def decode(self, ids: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._lockstep("decode", (ids, record), (ids, False))

    def select_rows(self, keep: list[int]) -> None:
        self._lockstep("select_rows", (keep,))

    def reset(self) -> None:
        self._lockstep("reset", ())

    # ---- memory ------------------------------------------------------------------------------
    def release_weights(self) -> None:
        self._lockstep("release_weights", ())

    def resume_weights(self) -> None:
        self._lockstep("resume_weights", ())

    def weight_bytes(self) -> int:
        """Bytes rank 0's parameters hold now (this process's)."""
        return self.local.weight_bytes()

    # ---- weights -----------------------------------------------------------------------------
    def param_names(self) -> set[str]:
        return self.local.param_names()

    def knows(self, name: str) -> bool:
        return self.local.knows(name)

    def missing_params(self, names: set[str]) -> set[str]:
        return self.local.missing_params(names)

    def tensor(self, name: str) -> torch.Tensor | None:
        """Rank 0's shard under an HF name (meta while released), or None."""
        return self.local.tensor(name)

    def update(
        self, source: Source, own: Callable[[], NamedTensors], new_version: bool = False
    ) -> int:
        """Stage an update on every rank (rank 0's tensors from ``own``, each worker's from
        ``source``), then commit it everywhere, or nowhere if a rank refused it."""
        local, workers = self.local, self.workers
        local.check_held()
        workers.send_each("stage", [(source.for_rank(k + 1),) for k in range(self.size - 1)])
        mine: Exception | None = None
        named: NamedTensors = []
        try:
            named = own()
            local.check(named)
        except Exception as e:  # answered below, once every rank has staged (or refused)
            mine = e
        theirs = [(k + 1, v) for k, (status, v) in enumerate(workers.answers()) if status != "ok"]
        if mine is not None or theirs:
            workers.send("discard")
            if mine is not None:
                raise mine
            raise RequestError("; ".join(f"engine TP rank {r}: {msg}" for r, msg in theirs))
        workers.send("commit", new_version)
        n = local.load(named)
        workers.expect_ok("commit")
        return n

    def load(self, named: NamedTensors) -> int:
        """Load full tensors on every rank (they travel pickled through the pipes)."""
        self.local.check_held()
        self.local.check(named)
        self.workers.send("load", named)
        n = self.local.load(named)
        self.workers.expect_ok("load")
        return n

    def full_tensor(self, name: str) -> torch.Tensor | None:
        """The whole checkpoint tensor ``name``, put together from every rank's shard."""
        mine = self.local.tensor(name)
        split = self.local.splits.get(name)
        if mine is None or split is None:
            return mine
        self.workers.send("shard", name)
        return split.join([mine, *self.workers.expect_ok("shard")])

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
        if rank_offset < 0 or rank_offset + self.size > world_size:
            raise RequestError(
                f"rank_offset {rank_offset} + tp_size {self.size} exceeds world_size "
                f"{world_size}: every engine TP rank joins the group (as rank_offset + k)"
            )
        workers = self.workers
        args = (master_address, master_port, rank_offset, world_size, group_name, backend)
        workers.send_each(
            "join", [(*args[:2], rank_offset + k + 1, *args[3:]) for k in range(self.size - 1)]
        )
        pg, mine = None, None
        try:
            pg = join_weight_update_group(*args)
        except Exception as e:
            mine = str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
        answers = workers.answers()
        failed = [(k + 1, v) for k, (status, v) in enumerate(answers) if status != "ok"]
        if mine is None and not failed:
            return pg
        if any(status == "ok" for status, _ in answers):
            workers.send("destroy", group_name)
            workers.answers()
        if pg is not None:
            destroy_weights_update_group(pg)
        errors = ([f"engine TP rank 0: {mine}"] if mine else []) + [
            f"engine TP rank {r}: {msg}" for r, msg in failed
        ]
        raise RequestError("could not join the weight update group: " + "; ".join(errors))

    def destroy_group(self, group_name: str) -> None:
        """Every worker leaves the group ``group_name`` (rank 0's is the caller's)."""
        self.workers.send("destroy", group_name)
        self.workers.expect_ok("destroy")

    def close(self) -> None:
        self.workers.close()


__all__ = ["TPError", "TPRunner", "Workers", "start_runner"]
