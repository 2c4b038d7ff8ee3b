"""``TitanTrainRayActor``: miles' ``TrainRayActor`` trained by Titan's Megatron base.

miles has no actor registry (``miles.ray.train.actor_factory`` picks Megatron or FSDP with an
if/else); ``python -m adapters.miles.train`` puts this class in through one substitution
around the creation of miles' ``RayTrainGroup`` (``adapters.miles.train.titan_train_actors``).
miles' group then calls the contract below on every trainer rank. Everything device-specific
goes through ``titan_core.accelerator``, so the same actor runs on CUDA, MUSA and CPU.

What runs of miles' own code here: ``TrainRayActor.__init__`` (rendezvous environment,
logger, miles' object store), ``init_gloo_group``, ``set_rollout_manager``, the heartbeat,
miles' object store and DP-split functions for the rollout data
(``adapters.miles.train_data``), ``TrainStepOutcome``, the HF-export completion marker and,
under ``--dump-details``, miles' train-data dump (``save_debug_train_data_for_rank``).
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from adapters.common.backend import TitanBackend, engine_urls, refuse_unsupported
from adapters.peers import import_peer
from titan_core.data.tokenizer import HF_TOKENIZER_FILES

_train_actor = import_peer("miles.ray.train_actor")


#: what an HF export copies from ``--hf-checkpoint`` beside the weights
_TOKENIZER_FILES = ("tokenizer.json", *HF_TOKENIZER_FILES, "generation_config.json")


class TitanTrainRayActor(_train_actor.TrainRayActor):
    """One trainer rank: the process group on Titan's accelerator, then Titan's policy
    trainer (``titan_rl.trainer.PolicyTrainer``, the one ``python -m titan_rl.grpo`` uses)
    through :class:`adapters.common.backend.TitanBackend`."""

    def __init__(
        self,
        args: Any,
        world_size: int,
        rank: int,
        master_addr: str | None,
        master_port: Any,
        indep_dp_store_addr: str | None = None,
        role: str = "actor",
        cell_index: int = 0,
    ) -> None:
        super().__init__(
            args, world_size, rank, master_addr, master_port, indep_dp_store_addr, role, cell_index
        )
        self.backend: Any = None
        self.rollout_manager: Any = None
        self.metrics: dict[str, float] = {}
        self.weight_version = 0

    # ---- miles' contract: set-up ----------------------------------------------------------------
    def init(
        self,
        args: Any,
        role: str,
        *,
        with_ref: bool = False,
        with_opd_teacher: bool = False,
        recv_ckpt_src_rank: int | None = None,
        indep_dp_info: Any = None,
    ) -> int:
        """The process group, then the trainer; returns the first rollout id (after the last
        checkpoint in ``--save``, else 0), equal on every rank.

        miles' ``TrainRayActor.init`` is not called: it runs ``torch.cuda.set_device`` and
        ``init_process_group(args.distributed_backend)`` unconditionally (no CUDA on CPU or
        MUSA; nccl is CUDA's backend) and sets NVML CPU affinity. Its steps that matter are
        done here with Titan's accelerator (``set_device``, ``communication_backend``) and
        miles' own ``init_gloo_group``, and ``args.rank`` / ``args.world_size`` are set as
        miles sets them.
        """
        refuse_unsupported("miles", role, with_opd_teacher)
        if recv_ckpt_src_rank is not None or (indep_dp_info and indep_dp_info.num_cells > 1):
            raise ValueError(
                "independent-DP cells and in-memory healing (--indep-dp, fault tolerance) are "
                "not supported by the Titan backend"
            )
        self.args, self.role = args, role
        self.with_ref, self.with_opd_teacher = with_ref, with_opd_teacher
        self._init_process_group(args)
        self.backend = TitanBackend(args, world_size=self._world_size, with_ref=with_ref)
        _set_memory_margin(args, self.backend)
        self._heartbeat.bump()
        start = self.backend.resume()
        if getattr(args, "offload_train", False):  # as miles' Megatron actor
            self.sleep()
        return start

    def _init_process_group(self, args: Any) -> None:
        import torch.distributed as dist

        from titan_core.accelerator import get_accelerator

        dist_utils = import_peer("miles.utils.distributed_utils")
        accel = get_accelerator()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        accel.set_device(accel.resolve_visible_device_id(local_rank))
        if not dist.is_initialized():
            dist.init_process_group(
                backend=accel.communication_backend(getattr(args, "distributed_backend", None)),
                timeout=timedelta(minutes=getattr(args, "distributed_timeout_minutes", 10)),
                device_id=accel.distributed_device_id(local_rank),
            )
        dist_utils.init_gloo_group()
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()

    @property
    def train_parallel_config(self) -> dict[str, int]:
        """What the rollout manager splits the data by (``build_dp_schedule``)."""
        return self.backend.train_parallel_config()

    def _get_parallel_config(self) -> dict[str, int]:
        return self.backend.parallel_config()

    # ---- miles' contract: training --------------------------------------------------------------
    def train(
        self,
        rollout_id: int,
        rollout_data_ref: Any,
        witness_info: Any = None,
        attempt: int = 0,
        external_data: Any = None,
    ) -> Any:
        """This DP rank's share of the rollout, one optimizer step per step of miles'
        schedule. Returns miles' ``TrainStepOutcome.NORMAL``; the metrics are kept for
        :meth:`get_metrics` (miles' group discards what ``train`` returns). A sleeping
        trainer wakes first (miles' group puts it back to sleep with ``offload``)."""
        from adapters.miles.train_data import rank_rollout_data, with_step_schedule

        self._heartbeat.bump()
        if external_data is not None:
            raise ValueError("critic values (external_data) are not supported by the Titan backend")
        par = self._get_parallel_config()
        data, got = rank_rollout_data(
            self.args, rollout_data_ref, par["dp_rank"], par["dp_size"], witness_info
        )
        with got:
            data = with_step_schedule(self.args, data, par["dp_size"])
            self.wake_up()
            metrics = self.backend.train(data)
            _dump_train_data(self.args, rollout_id, data)
        self.metrics = {"rollout_id": float(rollout_id), **metrics}
        self._heartbeat.bump()
        outcome = import_peer("miles.backends.megatron_utils.ft.types").TrainStepOutcome
        return outcome.NORMAL

    def get_metrics(self) -> dict[str, float]:
        """The last ``train`` and ``update_weights`` metrics of this rank."""
        return dict(self.metrics)

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """A Titan checkpoint in ``--save`` (and an HF export to ``--save-hf``, formatted
        with ``rollout_id``, when set, as miles does)."""
        self._heartbeat.bump()
        with self.backend.awake():  # asleep: back on the device for the save, then asleep
            self.backend.save(rollout_id)
        save_hf = getattr(self.args, "save_hf", None)
        if save_hf:
            self.export_hf(rollout_id, save_hf.format(rollout_id=rollout_id))

    def export_hf(self, rollout_id: int, path: str) -> None:
        """An HF directory of the current policy at ``path`` (every rank calls, rank 0
        writes): ``config.json``, ``model.safetensors``, the tokenizer files of
        ``--hf-checkpoint`` if it has any, then miles' completion marker."""
        import torch.distributed as dist

        marker = import_peer("miles.utils.hf_config").HF_EXPORT_COMPLETE_MARKER
        out = Path(path)
        if dist.get_rank() == 0:
            (out / marker).unlink(missing_ok=True)  # a stale marker would vouch for this one
        with self.backend.awake(weights_only=True):
            self.backend.save_hf(out)  # ends with a barrier
        if dist.get_rank() == 0:
            src = getattr(self.args, "hf_checkpoint", None)
            for name in _TOKENIZER_FILES if src and Path(src).is_dir() else ():
                if (Path(src) / name).is_file() and Path(src).resolve() != out.resolve():
                    shutil.copyfile(Path(src) / name, out / name)
            (out / marker).touch()

    # ---- miles' contract: weights -----------------------------------------------------------------
    def update_weights(self, info: Any) -> dict[str, float]:
        """Push the weights to ``info.rollout_engines`` (miles' ``EnginesAndLock``) as the
        next weight version, through Titan's ``sync.transport``: ``tensor`` (miles'
        colocated tensor update), ``distributed`` (broadcast), ``disk`` or ``mooncake``
        (miles' p2p). miles' engine lock is held (by rank 0) while the engines change;
        rank 0 reports the version to the rollout manager as miles' actor does. A sleeping
        trainer stays asleep but for its weights, on the device for the update (miles'
        actor updates while asleep, from a host copy of the weights)."""
        import ray
        import torch.distributed as dist

        self._heartbeat.bump()
        if getattr(self.args, "debug_train_only", False) or getattr(
            self.args, "debug_rollout_only", False
        ):
            return {}
        engines = list(info.rollout_engines)
        if not engines:
            return {}
        gloo = import_peer("miles.utils.distributed_utils").get_gloo_group()
        rank0 = dist.get_rank() == 0
        urls = engine_urls(engines)
        lock = info.rollout_engine_lock
        if rank0 and lock is not None:
            while not ray.get(lock.acquire.remote()):
                time.sleep(0.1)
        try:
            dist.barrier(group=gloo)
            self.weight_version += 1
            start = time.perf_counter()
            with self.backend.awake(weights_only=True):
                metrics = self.backend.update_engines(
                    urls, self.weight_version, reconnect=bool(info.has_new_engines)
                )
            metrics["time/update_weights"] = time.perf_counter() - start
            dist.barrier(group=gloo)
        finally:
            if rank0 and lock is not None:
                ray.get(lock.release.remote())
        if rank0 and self.rollout_manager is not None:
            refs = [self.rollout_manager.set_weight_version.remote(self.weight_version)]
            if info.has_new_engines:
                refs.append(self.rollout_manager.clear_updatable_has_new_engines.remote())
            ray.get(refs)
        self.metrics.update(metrics)
        return metrics

    def resync_engines(self, urls: list[str], version: str) -> dict[str, float]:
        """The current weights to engines a supervisor restarted (on the start-up weights),
        as ``version``; every rank, when the rollout manager's recovery asks."""
        self._heartbeat.bump()
        return self.backend.resync_engines(urls, version)

    # ---- miles' contract: memory ------------------------------------------------------------------
    def sleep(self, tags: Any = None) -> dict[str, float]:
        """Colocated offload (miles' ``RayTrainGroup.offload``; this actor itself after
        ``init`` under ``--offload-train``): the trainer's parameters, gradients, optimizer
        state and reference model leave the device (``TitanBackend.sleep``); returns
        ``memory/device_bytes_before_sleep`` / ``..._after_sleep``, also in
        :meth:`get_metrics`. ``tags`` do not apply: the trainer frees all of it. Asleep
        already: nothing."""
        if self.backend is None:
            return {}
        figures = self.backend.sleep()
        self.metrics.update(figures)
        return figures

    def wake_up(self, tags: Any = None) -> None:
        """Everything ``sleep`` released back on the device, as it was (miles'
        ``RayTrainGroup.onload``); awake already: nothing."""
        if self.backend is not None:
            self.backend.wake_up()

    def clear_memory(self) -> None:
        """miles' base version calls ``torch.cuda`` directly; this asks the accelerator."""
        self.backend.trainer.accel.synchronize()
        gc.collect()
        self.backend.trainer.accel.empty_cache()

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
            self.backend = None


def _set_memory_margin(args: Any, backend: TitanBackend) -> None:
    """``--train-memory-margin-bytes``, as miles' Megatron actor sets it: torch_memory_saver's
    ``memory_margin_bytes`` under ``--offload-train``, where torch_memory_saver offloads the
    trainer (elsewhere the trainer's sleep copies tensors to host memory: no margin)."""
    margin = int(getattr(args, "train_memory_margin_bytes", 0) or 0)
    saver = backend.memory.saver
    if getattr(args, "offload_train", False) and margin > 0 and saver is not None:
        saver.tms.memory_margin_bytes = margin


def _dump_train_data(args: Any, rollout_id: int, data: dict[str, Any]) -> None:
    """miles' train-data dump (``--dump-details``: ``train_data/<id>_<rank>.pt``): this
    rank's rollout data as it trained on it, by miles' own writer."""
    if getattr(args, "save_debug_train_data", None) is None:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import_peer("miles.utils.train_dump_utils").save_debug_train_data_for_rank(
        args, rollout_id=rollout_id, rollout_data=data, rank=dist.get_rank(),
        cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
    )  # fmt: skip
