"""``TitanTrainActor``: slime's ``TrainRayActor`` trained by Titan's Megatron base.

slime puts a custom actor class in through ``create_training_models(args, pgs,
rollout_manager, actor_cls=TitanTrainActor)`` (``python -m adapters.slime.train`` does);
its ``RayTrainGroup`` makes the class a Ray actor per trainer rank and calls the contract
below. Everything device-specific goes through slime's accelerator registry, where
``adapters.slime.register()`` put Titan's (``SLIME_ACCELERATOR=titan``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from adapters.common.backend import TitanBackend, engine_urls, refuse_unsupported
from adapters.peers import import_peer
from adapters.slime.accelerator import register

_train_actor = import_peer("slime.ray.train_actor")


class TitanTrainActor(_train_actor.TrainRayActor):
    """One trainer rank: slime's process-group set-up, then Titan's policy trainer
    (``titan_rl.trainer.PolicyTrainer``, the one ``python -m titan_rl.grpo`` trains with)."""

    def __init__(self, world_size: int, rank: int, master_addr: str | None, master_port: Any):
        register()  # this Ray worker's slime registry answers with Titan's accelerator
        super().__init__(world_size, rank, master_addr, master_port)
        # slime's logger set-up puts the root logger at INFO: keep one line per HTTP call
        # of the weight sync out of the job's output, as slime does for its rollout side
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.backend: Any = None
        self.rollout_manager: Any = None
        self.metrics: dict[str, float] = {}

    # ---- slime's contract ---------------------------------------------------------------------
    def init(self, args: Any, role: str, with_ref: bool = False, with_opd_teacher: bool = False):
        """Process group (slime's base class, the accelerator's backend), then the trainer;
        returns the first rollout id (after the last checkpoint in ``--save``, else 0).
        Under ``--offload-train`` (``--colocate``) the trainer then sleeps, as slime's
        Megatron actor does."""
        refuse_unsupported("slime", role, with_opd_teacher)
        super().init(args, role, with_ref=with_ref, with_opd_teacher=with_opd_teacher)
        self.backend = TitanBackend(args, world_size=self._world_size, with_ref=with_ref)
        self.weight_version = int(getattr(args, "update_weight_start_version", 0) or 0)
        start = self.backend.resume()
        if getattr(args, "offload_train", False):
            self.sleep()
        return start

    @property
    def train_parallel_config(self) -> dict[str, int]:
        """What the rollout manager splits the data by (``build_dp_schedule``)."""
        return self.backend.train_parallel_config()

    def _get_parallel_config(self) -> dict[str, int]:
        return self.backend.parallel_config()

    def train(self, rollout_id: int, rollout_data_ref: Any, external_data: Any = None):
        """This DP rank's share of the rollout (slime's ``process_rollout_data``), one
        optimizer step per step of slime's schedule; returns the metrics. A sleeping
        trainer wakes first and, under ``--offload-train``, sleeps again after (slime's
        Megatron actor does both; the sleep's memory figures join the metrics)."""
        data_mod = import_peer("slime.utils.data")
        par = self._get_parallel_config()
        data = data_mod.process_rollout_data(
            self.args, rollout_data_ref, par["dp_rank"], par["dp_size"]
        )
        self.wake_up()
        self.metrics = {"rollout_id": float(rollout_id), **self.backend.train(data)}
        if getattr(self.args, "offload_train", False):
            del data
            self.sleep()
        return self.metrics

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """A Titan checkpoint in ``--save`` (megatron-core torch_dist, Megatron-LM's layout:
        ``TitanBackend.save``), then, with ``--save-hf``, an HF snapshot at
        ``save_hf.format(rollout_id=rollout_id)`` as slime's Megatron actor writes one: the
        policy's config.json, model.safetensors and tokenizer, and the other files of
        ``--hf-checkpoint`` (e.g. its generation config). A sleeping trainer is on the
        device for these, then asleep again."""
        with self.backend.awake():  # asleep: back on the device for the save, then asleep
            self.backend.save(rollout_id)
        save_hf = getattr(self.args, "save_hf", None)
        if not save_hf:
            return
        out = Path(save_hf.format(rollout_id=rollout_id))
        hf = getattr(self.args, "hf_checkpoint", None)
        if hf and Path(hf).resolve() == out.resolve():  # as slime's HF saver refuses it
            raise ValueError(
                f"--save-hf {save_hf} names the --hf-checkpoint folder {hf}: the export would "
                "overwrite the model the run started from; give --save-hf another folder"
            )
        with self.backend.awake(weights_only=True):
            self.backend.save_hf(out, assets_from=hf)

    def update_weights(self) -> dict[str, float]:
        """The new weights to the rollout engines, as slime's ``--update-weight-transport``
        says: ``disk`` writes HF safetensors to ``update_weight_disk_dir/weight_vNNNNNN``
        (slime's group then reloads the engines); otherwise Titan's ``sync.transport``
        (tensor / distributed / disk / mooncake) pushes them to every engine. A sleeping
        trainer stays asleep but for its weights, on the device for the update (slime's
        actor updates while asleep, from a host copy of the weights)."""
        args = self.args
        if getattr(args, "debug_train_only", False):
            return {}
        with self.backend.awake(weights_only=True):
            return self._update_weights()

    def _update_weights(self) -> dict[str, float]:
        args = self.args
        self.weight_version += 1
        if (
            getattr(args, "update_weight_transport", None) == "disk"
            and getattr(args, "update_weight_mode", "full") == "full"
        ):
            out = Path(args.update_weight_disk_dir) / f"weight_v{self.weight_version:06d}"
            self.backend.save_hf(out)
            return {}
        if self.rollout_manager is None:
            raise RuntimeError("update_weights() before set_rollout_manager(): no engines known")
        import ray

        engines, *_ = ray.get(self.rollout_manager.get_updatable_engines_and_lock.remote())
        if not engines:
            return {}
        metrics = self.backend.update_engines(engine_urls(list(engines)), self.weight_version)
        import torch.distributed as dist

        if dist.get_rank() == 0:  # the version the rollout now accepts (and a resync sends)
            ray.get(self.rollout_manager.set_weight_version.remote(self.weight_version))
        return metrics

    def resync_engines(self, urls: list[str], version: str) -> dict[str, float]:
        """The current weights to engines a supervisor restarted (on the start-up weights),
        as ``version``; every rank, when the rollout manager's recovery asks."""
        return self.backend.resync_engines(urls, version)

    def sleep(self, tags: Any = None) -> dict[str, float]:
        """Colocated offload (slime's ``RayTrainGroup.offload``, and this actor itself under
        ``--offload-train``): the trainer's parameters, gradients, optimizer state and
        reference model leave the device (``TitanBackend.sleep``); returns
        ``memory/device_bytes_before_sleep`` / ``..._after_sleep``, also put in the metrics.
        ``tags`` (the engines' memory kinds) do not apply: the trainer frees all of it.
        Asleep already: nothing."""
        if self.backend is None:
            return {}
        figures = self.backend.sleep()
        self.metrics.update(figures)
        return figures

    def wake_up(self, tags: Any = None) -> None:
        """Everything ``sleep`` released back on the device, as it was (slime's
        ``RayTrainGroup.onload``); awake already: nothing."""
        if self.backend is not None:
            self.backend.wake_up()

    def export_hf(self, path: str) -> None:
        """An HF directory of the current policy (rank 0 writes)."""
        with self.backend.awake(weights_only=True):
            self.backend.save_hf(path)

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
