"""The Megatron policy trainer: one object per rank, the same training base as pretraining.

It owns the megatron-core model chunks, DDP, optimizer and (optionally) a frozen reference
model; computes old / reference logprobs with the forward-only schedule, advantages, and the
policy update with megatron-core's ``get_forward_backward_func`` (so TP/PP/VPP/EP/DP layouts
work as in pretraining), and exports HF weights bucket by bucket for weight sync.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from safetensors.torch import save_file

from titan_core.accelerator import megatron_scope
from titan_core.checkpoint import RELEASE, latest_iteration, load_checkpoint
from titan_core.checkpoint.dist import unwrap
from titan_core.data.tokenizer import build_tokenizer
from titan_core.models.gpt import build_model_chunks, build_transformer_config
from titan_core.models.hf import HFBridge, load_hf_weights, read_hf_config
from titan_core.models.hf.from_titan import hf_config_for
from titan_core.parallel.initialize import initialize
from titan_core.parallel.initialize import shutdown as shutdown_parallel
from titan_core.training.annotate import MicrobatchAnnotator
from titan_core.training.build import CheckpointSource, build_training
from titan_core.training.finite import check_finite_values, check_loss_and_grads, check_params
from titan_rl.algo.advantages import compute_advantages
from titan_rl.algo.losses import policy_loss
from titan_rl.algo.rollout_correction import mismatch_metrics, rollout_correction
from titan_rl.config import GRPOConfig
from titan_rl.trainer.batch import RLBatch
from titan_rl.trainer.microbatch import MicrobatchPlan, needed_lengths, plan_microbatches
from titan_rl.trainer.routing import RoutingReplay

#: what to look at when a loss, gradient or parameter is not finite
NONFINITE_HINT = (
    "Check the rewards (reward.custom_path, reward.on_invalid) and the size of the update "
    "(train.lr, train.clip_grad), then resume from the last checkpoint."
)


def without_padding_rows(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 ``logits`` (this TP rank's slice of the vocabulary) without the padding rows'
    scores (ids >= ``vocab_size``: megatron pads the vocabulary to a multiple of
    ``make_vocab_size_divisible_by`` x TP, an HF policy's extra rows load as zeros), so the
    softmax is over the vocabulary the engines sample from; a copy.

    With the whole vocabulary on this rank (TP 1) the padding rows are left out; under TP,
    where every rank's slice must keep its width, their scores are the float minimum (a
    probability of exactly 0). Leaving them out gives the same softmax over fewer columns,
    and spares the exp() of each minimum: an exp that underflows takes a CPU's slow path,
    ~12x the time of one that does not (half of the bench's 128-row vocabulary was such)."""
    x = logits.float()
    local = x.shape[-1]
    if parallel_state.get_tensor_model_parallel_world_size() == 1 and local > vocab_size:
        return x[..., :vocab_size].clone()
    start = parallel_state.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return x.clone() if x.data_ptr() == logits.data_ptr() else x
    ids = torch.arange(start, start + local, device=x.device)
    return x.masked_fill(ids >= vocab_size, torch.finfo(x.dtype).min)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(target) per position over the first ``vocab_size`` ids; vocab-parallel under
    TP (megatron's cross entropy, which works in place on its input: it gets a copy)."""
    x = without_padding_rows(logits, vocab_size).contiguous()
    return -tensor_parallel.vocab_parallel_cross_entropy(x, targets.contiguous())


def token_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    logp = torch.log_softmax(without_padding_rows(logits, vocab_size), dim=-1)
    return -(logp.exp() * logp).sum(-1)


#: the update's loss function hands its detached logprobs back under this key (the old
#: logprobs, when they are the update's own)
OLD_LOGPROBS_KEY = "old_logprobs"


def old_logprobs_forward_reason(cfg: GRPOConfig, tf: Any, rows: RLBatch) -> str | None:
    """Why ``rows`` needs a no-grad forward of its own for the old logprobs before the policy
    update; None: the update's own forward gives them (its logprobs, detached), so that
    forward is skipped.

    With one optimizer step per batch (``train.ppo_steps`` 1) the policy that the old logprobs
    describe is the one being trained, as TRL's GRPOTrainer and verl use (ratio 1; the
    gradient is the same). The separate forward stays where:

    - ``algo.recompute_old_logprobs`` asks for it;
    - ``train.ppo_steps`` > 1: the later updates' policy is not the old one;
    - the batch brings its own old logprobs (slime / miles, once for several steps): no
      forward either way;
    - ``algo.use_kl_in_reward``: the KL penalty (old - ref) goes into the advantages, which
      the update's loss reads;
    - ``algo.use_rs`` (MIS): the tokens it drops leave the loss normaliser (total_tokens,
      total_seqs), which the loss reads;
    - dropout (``hidden_dropout`` / ``attention_dropout`` > 0): the old forward runs in eval
      mode, the update's in train mode, so their logprobs differ;
    - sinkhorn load balancing or MoE input jitter: train-mode routers route otherwise than
      eval-mode ones.

    TIS and IcePop only weight tokens inside the loss (IcePop's popped tokens stay in the
    normaliser), from the same values; the mismatch metrics are taken after the update's
    forward; the routing agreement is counted in it (schedule forwards only, not activation
    recomputes). The reference forward does not read the old logprobs.
    """
    algo = cfg.algo
    if algo.recompute_old_logprobs:
        return "algo.recompute_old_logprobs=true"
    if cfg.train.ppo_steps != 1:
        return (
            f"train.ppo_steps={cfg.train.ppo_steps}: the updates after the first train another "
            "policy"
        )
    if rows.old_logprobs is not None:
        return "the batch brings its own old logprobs"
    if algo.use_kl_in_reward:
        return "algo.use_kl_in_reward=true: the advantages need old - ref before the update"
    if algo.use_rs:
        return "algo.use_rs=true: MIS sets the loss normaliser before the update"
    dropout = max(getattr(tf, "hidden_dropout", 0.0), getattr(tf, "attention_dropout", 0.0))
    if dropout > 0:
        return f"dropout {dropout:g}: the old forward runs without it (eval mode)"
    if getattr(tf, "moe_router_load_balancing_type", None) == "sinkhorn":
        return "sinkhorn routing: train-mode routers route otherwise than eval-mode ones"
    if getattr(tf, "moe_input_jitter_eps", None):
        return "MoE input jitter: train-mode routers see other inputs than eval-mode ones"
    return None


class PolicyTrainer:
    def __init__(self, cfg: GRPOConfig, world_size: int = 1) -> None:
        self.cfg = cfg
        self.pcfg = cfg.pretrain_view(world_size)
        self.accel, self.env, self.dp = initialize(self.pcfg)
        self.rank = dist.get_rank()
        self.tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model)
        source = None
        if cfg.policy.format == "hf":
            self.hf_config = read_hf_config(cfg.policy.load)
            vocab = int(self.hf_config["vocab_size"])
        else:
            vocab = cfg.model.vocab_size or self.tokenizer.vocab_size
            it = latest_iteration(cfg.policy.load)
            # the policy is the checkpoint's model, padding rows included, at any TP
            if it is not None:
                source = CheckpointSource(Path(cfg.policy.load), it, resume=False)
        replay = cfg.algo.routing_replay
        if replay and not cfg.model.num_moe_experts:
            raise ValueError(
                "algo.routing_replay=true replays MoE routing, but the policy has no experts "
                "(model.num_moe_experts unset); set algo.routing_replay=false"
            )
        self.setup = build_training(self.pcfg, self.accel, vocab, source, routing_replay=replay)
        self.tf, self.model = self.setup.tf, self.setup.model
        self.routing = RoutingReplay(replay, self.tf.sequence_parallel)
        #: mismatch/routing_agreement of the last old-logprob forward (None: not measured)
        self.routing_agreement: float | None = None
        self.optimizer, self.scheduler = self.setup.optimizer, self.setup.scheduler
        self.vocab_size = self.setup.vocab_size
        if cfg.policy.format == "titan":
            # the exported vocabulary: model.vocab_size where set (an HF model's, converted
            # to a Titan checkpoint), else the model's rows; megatron's padding rows beyond it
            # are not the engines'
            exported = min(cfg.model.vocab_size or self.vocab_size, self.vocab_size)
            self.hf_config = hf_config_for(cfg.model, exported, self.tokenizer.eod)
        self._load_policy(self.model)
        #: microbatch ranges of the policy updates on profiled steps (titan_rl.trainer.group)
        self.annotator = MicrobatchAnnotator([unwrap(c) for c in self.model])
        self.ref_model = None
        if cfg.algo.use_kl_loss or cfg.algo.use_kl_in_reward:
            # a config of its own: the policy's has since been given the DDP and optimizer
            # hooks (process groups), which megatron's MoE experts cannot deep-copy
            ref_tf = build_transformer_config(self.pcfg, self.accel, replay)
            ref = build_model_chunks(self.pcfg, ref_tf, self.vocab_size, self.accel)
            self._load_policy(ref)
            for chunk in ref:
                chunk.eval().requires_grad_(False)
            self.ref_model = ref
        self.bridge = HFBridge(self.hf_config)
        #: the ids the engines sample from (the exported HF vocabulary): the trainer's
        #: softmax covers these, not the padding rows beyond them
        self.sampled_vocab = int(self.hf_config["vocab_size"])
        self.save_dir = Path(cfg.run.dir) / "checkpoints"

    # ---- weights -------------------------------------------------------------------
    def _load_policy(self, model: list) -> None:
        p = self.cfg.policy
        if p.format == "hf":
            load_hf_weights([unwrap(c) for c in model], p.load)
            return
        it = latest_iteration(p.load)
        if it is None:
            raise FileNotFoundError(
                f"policy.load {p.load} holds no complete Titan checkpoint; pretrain one with "
                "python -m titan_core.pretrain or set policy.pretrain_config"
            )
        load_checkpoint(p.load, it, model, optimizer=None)

    def export_hf(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF tensors on rank 0, bucket by bucket; every rank must iterate."""
        return self.bridge.export([unwrap(c) for c in self.model], bucket_bytes, dst=0)

    def save_hf(self, path: str | Path) -> None:
        """An HF directory of the current policy: config.json, model.safetensors and the
        tokenizer (engines serving it match stop texts with it, as SGLang loads one)."""
        self.check_finite(f"HF export to {path}")
        tensors: dict[str, torch.Tensor] = {}
        for bucket in self.export_hf(self.cfg.sync.bucket_bytes):
            tensors.update({n: t.contiguous() for n, t in bucket})
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / "model.safetensors.tmp"))
            (out / "model.safetensors.tmp").replace(out / "model.safetensors")
            (out / "config.json").write_text(json.dumps(self.hf_config, indent=1))
            self.tokenizer.save_hf(out)
        if dist.is_initialized():
            dist.barrier()

    def check_finite(self, what: str) -> None:
        """NonFiniteError (on every rank) unless every parameter is finite: call before the
        weights leave the trainer (a sync, a checkpoint, an export)."""
        check_params(self.model, f"{what}: refused", NONFINITE_HINT)

    # ---- checkpoints -----------------------------------------------------------------
    def save(
        self,
        step: int,
        extra: dict[str, Any],
        keep_last: int = 2,
        retain_interval: int | None = None,
    ) -> None:
        """A checkpoint in ``save_dir``; older ones beyond ``keep_last`` are pruned (0: none),
        and with ``retain_interval`` as Megatron-LM's ``--save-retain-interval`` prunes."""
        self.check_finite(f"step {step}: checkpoint")
        self.setup.save(
            self.save_dir, step, extra, keep_last=keep_last, retain_interval=retain_interval
        )

    def resume(self, root: str | Path | None = None) -> dict[str, Any] | None:
        """Model, optimizer and common state of the newest checkpoint in ``root`` (default
        ``save_dir``); None where there is none, or only a release checkpoint (weights to
        start from, as Megatron-LM treats it)."""
        root = Path(root) if root is not None else self.save_dir
        it = latest_iteration(root)
        if it is None or it == RELEASE:
            return None
        return self.setup.load(CheckpointSource(root, it, resume=True))

    # ---- schedules -------------------------------------------------------------------
    def _local_rows(self, batch: RLBatch) -> RLBatch:
        n = len(batch)
        per = n // self.dp
        r = parallel_state.get_data_parallel_rank()
        return batch.rows(r * per, (r + 1) * per)

    def _plan(self, fields: dict[str, torch.Tensor], mask: torch.Tensor) -> MicrobatchPlan:
        """Rows sorted by length into microbatches, each cut to its longest row (one
        pipeline stage; stages exchange one fixed shape), see titan_rl.trainer.microbatch."""
        p = self.pcfg.parallel
        multiple = self.accel.sequence_multiple  # 8 on GPUs; a CPU gains nothing from padding
        if p.sequence_parallel:
            multiple = math.lcm(multiple, p.tensor_model_parallel_size)
        if p.context_parallel_size > 1:
            multiple = math.lcm(multiple, 2 * p.context_parallel_size)
        return plan_microbatches(
            needed_lengths(mask), self.cfg.train.micro_batch_size, fields["tokens"].shape[1],
            multiple, trim=parallel_state.get_pipeline_model_parallel_world_size() == 1,
        )  # fmt: skip

    @megatron_scope()
    def _run(
        self,
        model: list,
        fields: dict,
        plan: MicrobatchPlan,
        loss_fn: Callable[..., tuple[torch.Tensor, dict]],
        forward_only: bool,
    ) -> list[dict]:
        device = self.accel.device()
        its = [plan.batches(fields, device) for _ in model]
        num = plan.num
        annotate = not forward_only and self.annotator.active

        def forward_step(data_iterator, chunk):  # noqa: ANN001, ANN202
            mb = next(data_iterator)
            tokens = mb["tokens"]
            if "routed" in mb:  # this microbatch's rollout routing, for this chunk's routers
                self.routing.set_targets(chunk, mb["routed"])
            pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            pos = pos.expand_as(tokens)
            if not annotate:
                with self.routing.counting():  # not the activation recomputes in backward
                    logits = chunk(tokens, pos, None)
                return logits, partial(loss_fn, mb, num)
            vs = getattr(unwrap(chunk), "vp_stage", None) or 0
            with self.annotator.forward(vs) as bwd_name, self.routing.counting():
                logits = self.annotator.wrap_output(chunk(tokens, pos, None), bwd_name)
            return logits, partial(loss_fn, mb, num)

        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=its if len(model) > 1 else its[0],
                model=model if len(model) > 1 else model[0],
                num_microbatches=num,
                seq_length=plan.width,
                micro_batch_size=self.cfg.train.micro_batch_size,
                forward_only=forward_only,
            )
        finally:
            self.routing.clear(model)

    def _fields(self, rows: RLBatch) -> dict[str, torch.Tensor]:
        """The per-row tensors every forward needs: tokens, and the rollout's routing."""
        fields = {"tokens": rows.tokens}
        if rows.routed_experts is not None:
            fields["routed"] = rows.routed_experts
        elif self.cfg.algo.routing_replay:
            raise ValueError(
                "algo.routing_replay=true but the batch carries no routed experts; set "
                "rollout.return_routed_experts=true (and pack Samples whose "
                "rollout_routed_experts are set)"
            )
        return fields

    @torch.no_grad()
    def logprobs(
        self, batch: RLBatch, reference: bool = False, local: bool = False
    ) -> torch.Tensor | None:
        """Per-token logprobs of this DP rank's rows (None off the last pipeline stage);
        ``local``: ``batch`` is already this DP rank's rows. The policy's forward of a batch
        with routed experts also sets ``routing_agreement``."""
        model = self.ref_model if reference else self.model
        if model is None:
            return None

        def loss_fn(mb, num, logits):  # noqa: ANN001, ANN202
            lp = token_logprobs(logits[:, :-1], mb["tokens"][:, 1:], self.sampled_vocab)
            lp = torch.nn.functional.pad(lp, (0, plan.width - 1 - lp.shape[1]))  # to [B, L-1]
            return lp.sum() * 0.0, {"logprobs": lp.detach().cpu()}

        for chunk in model:
            chunk.eval()
        try:
            rows = batch if local else self._local_rows(batch)
            fields = self._fields(rows)
            plan = self._plan(fields, rows.response_mask)
            measure = not reference and "routed" in fields
            with self.routing.measure(model) if measure else contextlib.nullcontext():
                out = self._run(model, fields, plan, loss_fn, forward_only=True)
            if measure:
                self.routing_agreement = self.routing.agreement()
        finally:
            for chunk in self.model:
                chunk.train()
        if not out:
            return None
        return plan.restore(torch.cat([o["logprobs"] for o in out]))

    def train(
        self, batch: RLBatch, local: bool = False, step: int | None = None
    ) -> dict[str, float]:
        """Advantages, then ``train.ppo_steps`` optimizer steps on the batch; returns metrics.

        ``local``: ``batch`` holds this DP rank's rows only (slime and miles split a rollout
        over DP ranks themselves); sequences are then counted over the DP group, and rows
        without a trained token (padding) are not counted. ``step`` names the RL step in
        errors. Non-finite rewards, loss or gradients raise NonFiniteError before any
        optimizer step is applied. The old logprobs come from a forward of their own, or
        from the update's forward where :func:`old_logprobs_forward_reason` allows.
        """
        cfg = self.cfg
        start = time.perf_counter()
        where = f"step {step}" if step is not None else "policy update"
        rows = batch if local else self._local_rows(batch)
        device = self.accel.device()
        check_finite_values(rows.rewards, f"{where}: rewards", NONFINITE_HINT, device)
        if rows.advantages is not None:
            check_finite_values(rows.advantages, f"{where}: advantages", NONFINITE_HINT, device)
        # None: the update's forward gives the old logprobs (decided alike on every rank)
        reuse = old_logprobs_forward_reason(cfg, self.tf, rows) is None
        old = rows.old_logprobs
        if old is None and not reuse:
            old = self.logprobs(rows, local=True)
        ref = self.logprobs(rows, reference=True, local=True)
        is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        metrics: dict[str, float] = {}
        if is_last:
            kl = (old - ref) if (ref is not None and cfg.algo.use_kl_in_reward) else None
            if rows.advantages is None:
                adv = compute_advantages(
                    rows.rewards, cfg.rollout.n_samples_per_prompt, rows.response_mask,
                    cfg.algo, kl=kl, group=self._dp_group(),
                )  # fmt: skip
            elif rows.advantages.dim() == 1:  # one advantage per sequence, on every token
                adv = rows.advantages.float().unsqueeze(1) * rows.response_mask
            else:
                adv = rows.advantages.float() * rows.response_mask
            if reuse:  # no MIS: rollout_correction's mask is the response mask's tokens
                kept = rows.response_mask.bool().to(rows.response_mask.dtype)
            else:  # the normaliser counts only the tokens MIS keeps (as verl's response_mask)
                kept = self._mismatch(old, rows, metrics)
        else:
            adv = torch.zeros_like(rows.response_mask)
            old = torch.zeros_like(rows.response_mask)
            kept = rows.response_mask
        if self.routing_agreement is not None:  # of the old-logprob forward
            metrics["mismatch/routing_agreement"] = self.routing_agreement
            self.routing_agreement = None
        fields = {**self._fields(rows), "mask": rows.response_mask, "adv": adv}
        fields["rollout"] = rows.rollout_logprobs
        if not reuse:
            fields["old"] = old
        if ref is not None:
            fields["ref"] = ref
        plan = self._plan(fields, rows.response_mask)
        total_tokens = self._global_sum(kept.sum())
        if local:
            total_seqs = self._global_sum((kept.sum(1) > 0).sum())
        else:  # less the sequences MIS dropped whole
            dropped = (rows.response_mask.sum(1) > 0) & (kept.sum(1) == 0)
            total_seqs = float(len(batch)) - self._global_sum(dropped.sum())
        scale = self.dp  # DDP averages gradients over data-parallel ranks: undo it

        def loss_fn(mb, num, logits):  # noqa: ANN001, ANN202
            lp = token_logprobs(logits[:, :-1], mb["tokens"][:, 1:], self.sampled_vocab)
            ent = (
                token_entropy(logits[:, :-1], self.sampled_vocab) if cfg.algo.entropy_coef else None
            )
            loss, m = policy_loss(
                lp, lp.detach() if reuse else mb["old"], mb["adv"], mb["mask"], cfg.algo,
                rollout_logprobs=mb["rollout"], ref_logprobs=mb.get("ref"), entropy=ent,
                total_tokens=total_tokens, total_seqs=total_seqs,
            )  # fmt: skip
            # the schedule divides by the number of microbatches: undo, as the loss is
            # already normalized by the global token / sequence count
            loss = loss * num * scale
            got = {k: torch.tensor(float(v)) for k, v in m.items()}
            if reuse:  # the old logprobs, as logprobs() would return this microbatch's
                pad = (0, plan.width - 1 - lp.shape[1])
                got[OLD_LOGPROBS_KEY] = torch.nn.functional.pad(lp.detach(), pad).cpu()
            return loss, got

        # with reuse, the update's forward counts the routing agreement (as logprobs() does)
        measure = reuse and "routed" in fields
        for i in range(cfg.train.ppo_steps):
            with megatron_scope():
                for chunk in self.model:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                with self.routing.measure(self.model) if measure else contextlib.nullcontext():
                    out = self._run(self.model, fields, plan, loss_fn, forward_only=False)
                agreement = self.routing.agreement() if measure else None
                check_loss_and_grads(
                    self.model, [o["loss"] for o in out],
                    f"{where}, PPO step {i + 1} of {cfg.train.ppo_steps}", NONFINITE_HINT,
                    check_grads=not self.pcfg.train.fp16,  # the fp16 loss scaler skips inf steps
                )  # fmt: skip
                ok, grad_norm, _ = self.optimizer.step()
            if ok:
                self.scheduler.step(increment=len(batch))
        if reuse and out:  # the last stage: the old logprobs' measurements, as without reuse
            old = plan.restore(torch.cat([o.pop(OLD_LOGPROBS_KEY) for o in out]))
            self._mismatch(old, rows, metrics)
        if agreement is not None:  # of the update's forward
            metrics["mismatch/routing_agreement"] = agreement
        if out:
            for key in out[0]:
                metrics[f"train/{key}"] = float(torch.stack([o[key] for o in out]).mean())
        metrics["train/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        # measured inside the trainer, so the driver can tell compute from orchestration
        metrics["time/train_compute"] = time.perf_counter() - start
        return self._reduce_metrics(metrics)

    def _mismatch(
        self, old: torch.Tensor, rows: RLBatch, metrics: dict[str, float]
    ) -> torch.Tensor:
        """The rollout / trainer mismatch of this DP rank's ``rows`` into ``metrics``
        (collective over the DP group); returns the loss mask less the tokens MIS drops."""
        cfg, mask = self.cfg, rows.response_mask
        metrics["train/rollout_logprob_abs_diff"] = float(
            ((old - rows.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1)
        )
        correction = rollout_correction(old, rows.rollout_logprobs, mask, cfg.algo)
        metrics |= mismatch_metrics(
            old, rows.rollout_logprobs, mask, cfg.algo, group=self._dp_group(),
            device=self.accel.device(), dropped=correction.dropped,
        )  # fmt: skip
        return correction.mask

    def _dp_group(self) -> Any:
        """The data-parallel group, where there is more than one DP rank (else None)."""
        if self.dp > 1 and dist.is_initialized():
            return parallel_state.get_data_parallel_group()
        return None

    def _global_sum(self, value: torch.Tensor) -> float:
        t = value.detach().double().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return float(t)

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics as the last stage's DP ranks saw them, averaged, on every rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return metrics
        holder = [metrics if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, holder[0])
        got = [g for g in gathered if g]
        keys = set().union(*[g.keys() for g in got])
        return {k: sum(g.get(k, 0.0) for g in got) / len(got) for k in keys}

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            shutdown_parallel()
