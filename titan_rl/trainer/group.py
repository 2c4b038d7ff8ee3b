"""Ray actors running ``PolicyTrainer``: one process per Megatron rank, its own
torch.distributed group, placed on the job's placement group (titan_rl/placement.py)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import ray
import torch

from titan_core import startup_gc
from titan_core.accelerator import get_accelerator
from titan_core.accelerator.megatron_compat import import_megatron
from titan_core.checkpoint.dist import unwrap
from titan_core.net import free_port
from titan_core.openmp import wait_said
from titan_core.training.profiling import StepProfiler
from titan_rl.config import GRPOConfig
from titan_rl.nodes import enter_driver_dir
from titan_rl.sync.sync import WeightSync
from titan_rl.trainer.batch import RLBatch

if TYPE_CHECKING:
    from titan_rl.placement import Placement


class TrainerWorker:
    """One Megatron rank (plain class; ``TrainerGroup`` makes it a Ray actor)."""

    def __init__(self, cfg: dict[str, Any], rank: int, world_size: int, local_rank: int) -> None:
        enter_driver_dir()  # on a cluster: relative paths as the driver means them
        startup_gc.pause()  # megatron's import and the model's build; setup() settles it
        self._payload = cfg
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank

    def master_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a free port there: the process group's rendezvous."""
        return ray.util.get_node_ip_address(), free_port("")

    def setup(self, rendezvous: tuple[str, int]) -> None:
        """Join the process group at rank 0's ``master_address`` and build the trainer."""
        try:
            self._build(rendezvous)
        finally:  # built or not: the collector is on again
            startup_gc.settle()

    def _build(self, rendezvous: tuple[str, int]) -> None:
        master_addr, master_port = rendezvous
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        cfg, self._payload = self._payload, {}
        threads = cfg.pop("_torch_threads", None)
        if threads:
            torch.set_num_threads(int(threads))
        print(
            f"trainer rank {self.rank}: {torch.get_num_threads()} torch threads {wait_said()}",
            flush=True,
        )
        # megatron, in the trainer's process only (the driver holds this module too)
        import_megatron(get_accelerator())  # as the device runs it (on CPU, uncompiled)
        from titan_rl.trainer.policy import PolicyTrainer

        startup_gc.imported()  # megatron's and torch's objects: setup() collects the build's
        self.cfg = GRPOConfig.model_validate(cfg)
        self.trainer = PolicyTrainer(self.cfg, self.world_size)
        self.sync = None
        self.profiler = StepProfiler(
            self.cfg.profile, self.cfg.run.dir, self.rank, self.trainer.accel.profiler_activities()
        )
        self._profiled = contextlib.ExitStack()
        self._phases: dict[str, Any] = {}

    # ---- profiling: the driver opens and closes steps and the rollout phase -----------------
    def begin_step(self, step: int) -> None:
        """Open ``ProfilerStep#step`` (on profiled steps; a no-op otherwise)."""
        if self.profiler.active(step):
            self._profiled.enter_context(self.profiler.step(step))
            self._profiled.enter_context(self.trainer.annotator.step(True))

    def end_step(self, step: int) -> None:
        for rf in self._phases.values():
            rf.__exit__(None, None, None)
        self._phases.clear()
        self._profiled.close()  # leaves the annotator, closes the step (writes the trace)

    def mark(self, phase: str, begin: bool) -> None:
        """Open or close a ``titan/rl/<phase>`` range while a profiled step is open."""
        if not self.trainer.annotator.active:
            return
        if begin:
            rf = torch.profiler.record_function(f"titan/rl/{phase}")
            rf.__enter__()
            self._phases[phase] = rf
        elif phase in self._phases:
            self._phases.pop(phase).__exit__(None, None, None)

    def save_hf(self, path: str) -> None:
        self.trainer.save_hf(path)

    def connect_engines(self, urls: list[str], agents: list[str] | None = None) -> None:
        """Sync metrics come back from ``sync_weights``; the driver writes metrics.jsonl.
        ``agents``: the Mooncake agents started beside the engines (WeightSync's)."""
        self._chunks = [unwrap(c) for c in self.trainer.model]
        self.sync = WeightSync(
            self.cfg.sync,
            urls,
            self.trainer.hf_config,
            api_key=self.cfg.engines.api_key,
            device=self.trainer.accel.device(),
            supervised=True,  # a dead engine is restarted and resynced (actors/recovery.py)
            client=self.cfg.engines.client,
            agents=agents,
        )
        self.sync.warm_up()  # while the engines run the first rollout

    def sync_weights(self, step: int) -> dict[str, float]:
        """Push the weights to the engines; NonFiniteError (nothing sent) if any is not
        finite, so an engine never serves a poisoned model."""
        if self.sync is None:
            raise RuntimeError("connect_engines() first")
        self.trainer.check_finite(f"step {step}: weight sync")
        self.mark("sync", True)
        try:
            return self.sync.sync(self._chunks, step)
        finally:
            self.mark("sync", False)

    def resync_engines(self, urls: list[str], version: str) -> dict[str, float]:
        """Send the weights held now to restarted engines as ``version`` (WeightSync.resync)."""
        if self.sync is None:
            raise RuntimeError("connect_engines() first")
        self.trainer.check_finite(f"resync of {urls}")
        return self.sync.resync(self._chunks, urls, version)

    def train(self, batch: RLBatch, step: int | None = None) -> dict[str, float]:
        self.mark("train", True)
        try:
            return self.trainer.train(batch, step=step)
        finally:
            self.mark("train", False)

    def shutdown_profiler(self) -> None:
        self._profiled.close()
        self.profiler.close()

    def save(self, step: int, extra: dict[str, Any]) -> None:
        self.trainer.save(step, extra)

    def resume(self) -> dict[str, Any] | None:
        return self.trainer.resume()

    def shutdown(self) -> None:
        if not hasattr(self, "trainer"):  # its setup did not complete: nothing was built
            return
        self.shutdown_profiler()
        if self.sync is not None:
            self.sync.close()
        self.trainer.shutdown()


class TrainCall:
    """A policy update in flight on every rank (``TrainerGroup.train_async``)."""

    def __init__(self, refs: list[Any]) -> None:
        self.refs = refs  # one Ray object ref per rank

    def result(self) -> dict[str, float]:
        """Rank 0's metrics once every rank has finished (a rank's error is raised here)."""
        return ray.get(self.refs)[0]


class TrainerGroup:
    """Driver-side handle of the trainer actors; every call goes to all ranks.

    Rank r runs on the placement's slot r; the process group meets at rank 0's node. The
    group owns the placement group (it outlives the engines) and removes it on shutdown.
    """

    def __init__(self, cfg: GRPOConfig, placement: Placement) -> None:
        n = cfg.trainer.num_processes
        self.placement = placement
        worker_cls = ray.remote(TrainerWorker)
        payload = cfg.model_dump(mode="json", by_alias=True)
        threads = placement.plan.threads
        if threads is not None:  # the plan's, also in each rank's environment
            payload["_torch_threads"] = threads.trainer
        self.workers = [
            worker_cls.options(**placement.trainer_options(r)).remote(
                dict(payload), r, n, placement.trainer_local_rank(r)
            )
            for r in range(n)
        ]
        # every rank builds at once, meeting at rank 0's address (Ray passes it on when it
        # is known); the driver starts the engines meanwhile and waits in ready()
        rendezvous = self.workers[0].master_address.remote()
        self._setup: list[Any] | None = [w.setup.remote(rendezvous) for w in self.workers]

    def ready(self) -> None:
        """Wait until every rank is built (a rank's error in building is raised here)."""
        if self._setup is not None:
            refs, self._setup = self._setup, None
            ray.get(refs)

    def _all(self, method: str, *args: Any) -> list[Any]:
        self.ready()
        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def connect_engines(self, urls: list[str], agents: list[str] | None = None) -> None:
        """Every rank's weight sync to the engines at ``urls`` (``agents``: the Mooncake
        agents started beside them, in their order; None: none started)."""
        self._all("connect_engines", urls, agents)

    def sync_weights(self, step: int) -> dict[str, float]:
        return self._all("sync_weights", step)[0]

    def resync_engines(self, urls: list[str], version: str) -> dict[str, float]:
        """Runs after the work already sent to the trainers (Ray keeps each actor's order)."""
        return self._all("resync_engines", urls, version)[0]

    def train_async(self, batch: RLBatch, step: int | None = None) -> TrainCall:
        """Start the policy update on every rank and return at once, so the driver can roll
        out the next step meanwhile (async rollout); ``.result()`` waits for it."""
        self.ready()
        return TrainCall([w.train.remote(batch, step) for w in self.workers])

    def train(self, batch: RLBatch, step: int | None = None) -> dict[str, float]:
        return self.train_async(batch, step).result()

    def begin_step(self, step: int) -> None:
        self._all("begin_step", step)

    def end_step(self, step: int) -> None:
        self._all("end_step", step)

    def mark(self, phase: str, begin: bool) -> None:
        self._all("mark", phase, begin)

    def save(self, step: int, extra: dict[str, Any]) -> None:
        self._all("save", step, extra)

    def resume(self) -> dict[str, Any] | None:
        return self._all("resume")[0]

    def shutdown(self) -> None:
        try:
            if self._setup is None:  # built: leave the process group cleanly
                self._all("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
            self.placement.remove()
