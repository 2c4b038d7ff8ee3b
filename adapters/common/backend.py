"""What slime's ``TitanTrainActor`` and miles' ``TitanTrainRayActor`` share: Titan's Megatron
policy trainer (the one ``titan_rl`` trains with) built from the framework's arguments, fed
the framework's rollout data, and Titan's weight sync to the SGLang-API engines.

One object per trainer rank, made inside the framework's Ray actor after its process group
exists (``titan_core.parallel.initialize`` then only adds megatron's groups).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from adapters.common.config import titan_config_from_args
from adapters.common.rollout_data import step_batches
from titan_rl.config import GRPOConfig

log = logging.getLogger(__name__)


def engine_urls(engines: list[Any]) -> list[str]:
    """Base URLs of rollout engines given as URLs or as engine actors: those with
    ``get_url`` (slime's ``SGLangEngine``, ``adapters.common.engines.EngineHandle``) through
    it, miles' ``SGLangEngine`` through the ``url`` of its ``get_topology_info()``."""
    import ray

    refs = {}
    for i, e in enumerate(engines):
        if not isinstance(e, str):
            refs[i] = e.get_url.remote() if hasattr(e, "get_url") else e.get_topology_info.remote()
    got = dict(zip(refs, ray.get(list(refs.values())), strict=True)) if refs else {}
    return [
        e if isinstance(e, str) else got[i] if isinstance(got[i], str) else got[i]["url"]
        for i, e in enumerate(engines)
    ]


def refuse_unsupported(framework: str, role: str, with_opd_teacher: bool) -> None:
    """A trainer role or mode the Titan backend does not run: an error before any set-up."""
    if role != "actor":
        raise ValueError(
            f"Titan's {framework} train actor trains the policy (role 'actor'), not {role!r}: "
            "a critic (--use-critic, PPO) is not supported by the Titan backend"
        )
    if with_opd_teacher:
        raise ValueError("on-policy distillation (--use-opd) is not supported by Titan")


#: torch_memory_saver's tag of the trainer's allocations (region set-up only)
MEMORY_SAVER_TAG = "titan_train"


class TitanBackend:
    """Titan's policy trainer and weight sync for one rank of a slime / miles job."""

    def __init__(self, args: Any, world_size: int, with_ref: bool = False) -> None:
        from titan_core.accelerator import get_accelerator
        from titan_core.accelerator.megatron_compat import import_megatron

        import_megatron()  # before the trainer's modules (CPU: uncompiled)
        from titan_core.checkpoint.dist import unwrap
        from titan_core.training.device_memory import TrainerMemory, trainer_tensors
        from titan_rl.trainer.policy import PolicyTrainer

        self.args = args
        self.cfg: GRPOConfig = titan_config_from_args(args)
        # torch_memory_saver (where its hook is loaded) releases what the trainer allocates
        # in its region: the model, DDP's buffers and the optimizer (made here, the Adam
        # state at the first step, inside :meth:`train`)
        saver = get_accelerator().memory_saver(MEMORY_SAVER_TAG)
        with saver.region() if saver is not None else contextlib.nullcontext():
            self.trainer = PolicyTrainer(self.cfg, world_size)
        t = self.trainer
        #: the trainer's device memory: sleep() frees it while a colocated engine runs
        self.memory = TrainerMemory(
            t.accel, lambda: trainer_tensors(t.model, t.optimizer, t.ref_model), saver
        )
        #: what is on the device for a block while asleep: None, "weights" or "all"
        self._resident: str | None = None
        if getattr(args, "save", None):
            self.trainer.save_dir = Path(args.save)
        self.chunks = [unwrap(c) for c in self.trainer.model]
        if with_ref and self.trainer.ref_model is None:
            log.warning(
                "the framework asked for a reference model; Titan builds one with --use-kl-loss"
            )
        if getattr(args, "titan_export_hf_checkpoint", False):
            # the driver's engines start from the policy itself (no --hf-checkpoint given)
            self.save_hf(args.hf_checkpoint)
        self._sync: Any = None
        self._sync_urls: list[str] = []

    # ---- layout ------------------------------------------------------------------------------
    def parallel_config(self) -> dict[str, int]:
        """slime's ``train_parallel_config`` (what its rollout manager splits data by)."""
        from megatron.core import parallel_state as ps

        p = self.cfg.parallel
        return {
            "dp_size": ps.get_data_parallel_world_size(),
            "dp_rank": ps.get_data_parallel_rank(),
            "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "cp_size": ps.get_context_parallel_world_size(),
            "vpp_size": p.virtual_pipeline_model_parallel_size or 1,
            "microbatch_group_size_per_vp_stage": p.pipeline_model_parallel_size,
        }

    def train_parallel_config(self) -> dict[str, int]:
        """What the framework's rollout manager splits data by (``build_dp_schedule``)."""
        cfg = self.parallel_config()
        keys = ("dp_size", "cp_size", "vpp_size", "microbatch_group_size_per_vp_stage")
        return {k: cfg[k] for k in keys}

    # ---- training -----------------------------------------------------------------------------
    def train(self, rollout_data: dict[str, Any]) -> dict[str, float]:
        """One rollout's optimizer steps on this DP rank's data; returns the last step's
        metrics (averaged over the last pipeline stage's DP ranks) with timings."""
        self._require_awake("train")
        start = time.perf_counter()
        pad = self.trainer.tokenizer.eod
        batches = step_batches(rollout_data, pad, self.cfg.train.micro_batch_size)
        # the policy before this rollout's updates: the PPO ratio's denominator in every step
        for b in batches:
            old = self.trainer.logprobs(b, local=True)
            b.old_logprobs = torch.zeros_like(b.response_mask) if old is None else old
        metrics: dict[str, float] = {}
        with self.memory.region():  # the Adam state is made at the first step
            for b in batches:
                metrics = self.trainer.train(b, local=True)
        metrics["train/steps"] = float(len(batches))
        metrics["time/train_rollout"] = time.perf_counter() - start
        return metrics

    # ---- weights ------------------------------------------------------------------------------
    def update_engines(
        self, urls: list[str], version: int | str, *, reconnect: bool = False
    ) -> dict[str, float]:
        """Push the weights to ``urls`` as ``version`` through ``sync.transport`` (every rank
        calls; the engine set may change between calls: a new sync is made for a new set,
        or with ``reconnect`` for restarted engines at the same URLs, miles'
        ``has_new_engines``)."""
        from titan_rl.sync.sync import WeightSync

        self._require_awake("a weight update", weights_only=True)
        if self._sync is None or urls != self._sync_urls or reconnect:
            if self._sync is not None:
                self._sync.close()
            self._sync = WeightSync(
                self.cfg.sync,
                urls,
                self.trainer.hf_config,
                api_key=self.cfg.engines.api_key,
                device=self.trainer.accel.device(),
                # the run's own engines are restarted by their supervisors and resynced by
                # the rollout manager's recovery (adapters.common.engine_recovery); external
                # ones (miles' --rollout-external) are not
                supervised=not getattr(self.args, "rollout_external", False),
                client=self.cfg.engines.client,
            )
            self._sync_urls = list(urls)
        step = int(version) if str(version).isdigit() else 0
        return self._sync.sync(self.chunks, step, version=str(version))

    def resync_engines(self, urls: list[str], version: str) -> dict[str, float]:
        """The weights this trainer holds to the restarted engines at ``urls`` alone, as
        ``version`` (every rank calls; the rollout manager's ``EngineRecovery`` asks for
        it when an engine's supervisor restarted it on the start-up weights)."""
        if self._sync is None:
            raise RuntimeError("a resync before the first weight update: no engines known")
        with self.awake(weights_only=True):
            return self._sync.resync(self.chunks, list(urls), str(version))

    def save_hf(self, path: str | Path, assets_from: str | Path | None = None) -> None:
        """An HF directory of the current policy (every rank calls; rank 0 writes):
        config.json, model.safetensors and the tokenizer. ``assets_from`` (slime's
        ``--save-hf``: the ``--hf-checkpoint`` folder): its files that are not weights and
        that the export did not write (generation config, chat template, model code) are
        copied in, as slime's HF saver copies them."""
        import shutil

        import torch.distributed as dist

        self._require_awake("an HF export", weights_only=True)
        self.trainer.save_hf(path)
        out, src = Path(path), Path(assets_from) if assets_from else None
        if src is None or not src.is_dir() or src.resolve() == out.resolve():
            return
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        weights = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
        for item in sorted(src.iterdir()):
            is_weights = item.name.endswith(weights) or item.name.endswith(".index.json")
            if item.is_file() and not is_weights and not (out / item.name).exists():
                shutil.copy2(item, out / item.name)

    # ---- colocation: the trainer's device memory ------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self.memory.asleep

    def sleep(self) -> dict[str, float]:
        """Free the device for a colocated engine: parameters, DDP's gradient and parameter
        buffers, the optimizer state (fp32 main parameters included) and the reference
        model leave the device (torch_memory_saver's pause where its hook is loaded, else
        copies to host memory, pinned on a GPU); returns ``memory/device_bytes_before_sleep``
        and ``..._after_sleep`` (the storage counter). Asleep already: nothing, ``{}``."""
        if self._resident is not None:
            raise RuntimeError("sleep() inside a block that needs the trainer on the device")
        return self.memory.sleep()

    def wake_up(self) -> None:
        """Everything :meth:`sleep` released back on the device, bit-identical (awake
        already: nothing)."""
        if self._resident is None:
            self.memory.wake_up()

    @contextlib.contextmanager
    def awake(self, weights_only: bool = False) -> Iterator[None]:
        """The trainer on the device inside the block; a sleeping trainer sleeps again
        after it. ``weights_only``: only the weights come back (a weight sync or an HF
        export, which only read them; torch_memory_saver brings everything)."""
        if not self.memory.asleep or self._resident is not None:
            yield
            return
        if weights_only:
            self._resident = "weights"
            try:
                with self.memory.weights_resident():
                    yield
            finally:
                self._resident = None
            return
        self.memory.wake_up()
        self._resident = "all"
        try:
            yield
        finally:
            self._resident = None
            self.memory.sleep()

    def device_bytes(self) -> int:
        """The storage counter: bytes the model(s), gradients and optimizer state hold on
        the trainer's device now."""
        return self.memory.device_bytes()

    def _require_awake(self, what: str, weights_only: bool = False) -> None:
        """A sleeping trainer's storages are freed: reading them would be garbage."""
        if not self.memory.asleep or self._resident == "all":
            return
        if weights_only and self._resident == "weights":
            return
        raise RuntimeError(
            f"{what} while the trainer is asleep (its device memory released by sleep()): "
            "call wake_up() first, or run it inside TitanBackend.awake()"
        )

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, rollout_id: int) -> None:
        """A checkpoint after rollout ``rollout_id`` in ``--save``, numbered as slime's and
        miles' Megatron actors number theirs: iteration ``rollout_id`` (Megatron-LM's loader
        resumes them at the next rollout), Titan's ``step`` the next rollout too. None is
        pruned (slime's and Megatron-LM's ``--save`` keep every one) unless
        ``--save-retain-interval N``: then, as Megatron-LM does, the previous checkpoint
        goes unless its iteration is a multiple of N."""
        self._require_awake("a checkpoint")
        self.trainer.save(
            rollout_id,
            # "step" (the first rollout a resume runs) replaces the trainer's own (the iteration)
            {"rollout_id": rollout_id, "step": rollout_id + 1},
            keep_last=0,
            retain_interval=getattr(self.args, "save_retain_interval", None),
        )

    def resume(self) -> int:
        """The first rollout id to run: after the newest checkpoint of the resume folder
        (``adapters.common.config.resume_dir``: ``--load``, else ``--save``, when it holds an
        RL run's checkpoint), else 0 (a fresh run from the policy's start weights)."""
        from adapters.common.config import resume_dir

        root = resume_dir(self.args)
        common = self.trainer.resume(root) if root else None
        return int(common["step"]) if common else 0

    def shutdown(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        self.trainer.shutdown()
