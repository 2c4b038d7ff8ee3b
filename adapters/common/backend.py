"""What slime's ``TitanTrainActor`` and miles' ``TitanTrainRayActor`` share: Titan's Megatron
policy trainer (the one ``titan_rl`` trains with) built from the framework's arguments, fed
the framework's rollout data, and Titan's weight sync to the SGLang-API engines.

One object per trainer rank, made inside the framework's Ray actor after its process group
exists (``titan_core.parallel.initialize`` then only adds megatron's groups).
"""

from __future__ import annotations

import logging
import time
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


class TitanBackend:
    """Titan's policy trainer and weight sync for one rank of a slime / miles job."""

    def __init__(self, args: Any, world_size: int, with_ref: bool = False) -> None:
        from titan_core.checkpoint.dist import unwrap
        from titan_rl.trainer.policy import PolicyTrainer

        self.args = args
        self.cfg: GRPOConfig = titan_config_from_args(args)
        self.trainer = PolicyTrainer(self.cfg, world_size)
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
        start = time.perf_counter()
        pad = self.trainer.tokenizer.eod
        batches = step_batches(rollout_data, pad, self.cfg.train.micro_batch_size)
        # the policy before this rollout's updates: the PPO ratio's denominator in every step
        for b in batches:
            old = self.trainer.logprobs(b, local=True)
            b.old_logprobs = torch.zeros_like(b.response_mask) if old is None else old
        metrics: dict[str, float] = {}
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

        if self._sync is None or urls != self._sync_urls or reconnect:
            if self._sync is not None:
                self._sync.close()
            self._sync = WeightSync(
                self.cfg.sync,
                urls,
                self.trainer.hf_config,
                api_key=self.cfg.engines.api_key,
                device=self.trainer.accel.device(),
            )
            self._sync_urls = list(urls)
        step = int(version) if str(version).isdigit() else 0
        return self._sync.sync(self.chunks, step, version=str(version))

    def save_hf(self, path: str | Path) -> None:
        """An HF directory of the current policy (every rank calls; rank 0 writes)."""
        self.trainer.save_hf(path)

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, rollout_id: int) -> None:
        """A Titan checkpoint after rollout ``rollout_id``; a resume starts at the next one."""
        self.trainer.save(rollout_id + 1, {"rollout_id": rollout_id})

    def resume(self) -> int:
        """The first rollout id to run: after the last checkpoint in ``--save``, else 0."""
        common = self.trainer.resume()
        return int(common["step"]) if common else 0

    def shutdown(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        self.trainer.shutdown()
