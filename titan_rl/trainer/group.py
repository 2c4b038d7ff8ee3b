"""Ray actors running ``PolicyTrainer``: one process per Megatron rank, its own
torch.distributed group, placed with a Ray placement group."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from titan_rl.config import GRPOConfig
from titan_rl.trainer.batch import RLBatch


class TrainerWorker:
    """One Megatron rank (plain class; ``TrainerGroup`` makes it a Ray actor)."""

    def __init__(
        self, cfg: dict[str, Any], rank: int, world_size: int, master_addr: str, master_port: int
    ) -> None:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        import torch

        threads = cfg.pop("_torch_threads", None)
        if threads:
            torch.set_num_threads(int(threads))
        from titan_core.training.profiling import StepProfiler
        from titan_rl.trainer.policy import PolicyTrainer

        self.cfg = GRPOConfig.model_validate(cfg)
        self.trainer = PolicyTrainer(self.cfg, world_size)
        self.rank = rank
        self.sync = None
        self.profiler = StepProfiler(
            self.cfg.profile, self.cfg.run.dir, rank, self.trainer.accel.device_type
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
            import torch

            rf = torch.profiler.record_function(f"titan/rl/{phase}")
            rf.__enter__()
            self._phases[phase] = rf
        elif phase in self._phases:
            self._phases.pop(phase).__exit__(None, None, None)

    def save_hf(self, path: str) -> None:
        self.trainer.save_hf(path)

    def connect_engines(self, urls: list[str]) -> None:
        """Sync metrics come back from ``sync_weights``; the driver writes metrics.jsonl."""
        from titan_core.checkpoint.dist import unwrap
        from titan_rl.sync.sync import WeightSync

        self._chunks = [unwrap(c) for c in self.trainer.model]
        self.sync = WeightSync(
            self.cfg.sync,
            urls,
            self.trainer.hf_config,
            api_key=self.cfg.engines.api_key,
            device=self.trainer.accel.device(),
        )

    def sync_weights(self, step: int) -> dict[str, float]:
        if self.sync is None:
            raise RuntimeError("connect_engines() first")
        self.mark("sync", True)
        try:
            return self.sync.sync(self._chunks, step)
        finally:
            self.mark("sync", False)

    def train(self, batch: RLBatch) -> dict[str, float]:
        self.mark("train", True)
        try:
            return self.trainer.train(batch)
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
        self.shutdown_profiler()
        if self.sync is not None:
            self.sync.close()
        self.trainer.shutdown()


class TrainerGroup:
    """Driver-side handle of the trainer actors; every call goes to all ranks."""

    def __init__(self, cfg: GRPOConfig, torch_threads: int | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from titan_core.parallel.initialize import free_port

        n = cfg.trainer_processes
        self.pg = placement_group([{"CPU": 1}] * n, strategy="PACK")
        ray.get(self.pg.ready())
        worker_cls = ray.remote(num_cpus=1)(TrainerWorker)
        port = free_port()
        payload = cfg.model_dump(mode="json", by_alias=True)
        if torch_threads:
            payload["_torch_threads"] = torch_threads
        self.workers = [
            worker_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                )
            ).remote(dict(payload), i, n, "127.0.0.1", port)
            for i in range(n)
        ]

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def connect_engines(self, urls: list[str]) -> None:
        self._all("connect_engines", urls)

    def sync_weights(self, step: int) -> dict[str, float]:
        return self._all("sync_weights", step)[0]

    def train(self, batch: RLBatch) -> dict[str, float]:
        return self._all("train", batch)[0]

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
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            self._all("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
            remove_placement_group(self.pg)
