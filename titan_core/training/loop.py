"""The pretraining loop: megatron-core's schedules, DDP and optimizer, Titan's bookkeeping."""

from __future__ import annotations

import contextlib
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from titan_core.accelerator import Accelerator, get_accelerator, megatron_scope
from titan_core.checkpoint import latest_iteration
from titan_core.checkpoint.dist import RELEASE, iteration_dir, iteration_name, unwrap
from titan_core.config.pretrain import PretrainConfig
from titan_core.data.gpt import build_gpt_datasets, microbatches
from titan_core.data.tokenizer import build_tokenizer
from titan_core.parallel.nodes import describe_rank
from titan_core.parallel.p2p_mooncake import p2p_schedule_kwargs
from titan_core.signals import StopSignals, signal_name
from titan_core.training.annotate import MicrobatchAnnotator
from titan_core.training.build import CheckpointSource, build_training
from titan_core.training.finite import check_loss_and_grads, check_params
from titan_core.training.metrics import MetricsWriter, drop_records_after, format_status
from titan_core.training.moe_load import MoELoadTracker
from titan_core.training.profiling import StepProfiler


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):  # noqa: ANN201
    """Token-mean cross entropy of one microbatch, as megatron's pretrain_gpt reports it."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask) / torch.clamp(mask.sum(), min=1.0)
    # clone: the schedule divides the returned loss in place by the number of microbatches
    return loss, {"lm loss": loss.detach().clone()}


def make_forward_step(device: torch.device, annotator: MicrobatchAnnotator):  # noqa: ANN201
    def forward_step(data_iterator, model, return_schedule_plan: bool = False):  # noqa: ANN001, ANN202
        batch = next(data_iterator)
        tokens = batch["tokens"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        loss_mask = batch["loss_mask"].to(device, non_blocking=True)
        position_ids = batch["position_ids"].to(device, non_blocking=True)
        if return_schedule_plan:
            # EP comm/compute overlap: megatron's combined-1F1B schedule runs the plan.
            plan = model.build_schedule_plan(
                tokens, position_ids, None, labels=labels, loss_mask=loss_mask
            )
            return plan, partial(loss_func, loss_mask)
        with annotator.forward(getattr(unwrap(model), "vp_stage", None) or 0) as bwd_name:
            output = model(tokens, position_ids, None, labels=labels)
            output = annotator.wrap_output(output, bwd_name)
        return output, partial(loss_func, loss_mask)

    return forward_step


def exact_match_stats(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked token-mean cross entropy, rows right, rows scored.

    A row is right when the argmax is the label at every position of its loss mask: for
    prompt/answer rows, the whole answer as greedy decoding would write it (teacher forcing
    gives greedy decoding's inputs as long as every earlier answer token was right).
    """
    logits = logits.float()
    mask = loss_mask.float()
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    ).reshape(labels.shape)
    loss = torch.sum(losses * mask) / torch.clamp(mask.sum(), min=1.0)
    wrong = ((logits.argmax(-1) != labels) & (mask > 0)).any(-1)
    scored = mask.sum(-1) > 0
    return loss, (scored & ~wrong).sum().double(), scored.sum().double()


def eval_loss_func(labels: torch.Tensor, loss_mask: torch.Tensor, logits: torch.Tensor):  # noqa: ANN201
    """Eval loss and exact match of one microbatch (logits gathered over TP first)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    loss, correct, rows = exact_match_stats(logits, labels, loss_mask)
    return loss, {"eval loss": loss.detach().clone(), "correct": correct, "rows": rows}


def make_eval_step(device: torch.device):  # noqa: ANN201
    def eval_step(data_iterator, model):  # noqa: ANN001, ANN202
        batch = next(data_iterator)
        tokens = batch["tokens"].to(device)
        labels = batch["labels"].to(device)
        loss_mask = batch["loss_mask"].to(device)
        position_ids = batch["position_ids"].to(device)
        logits = model(tokens, position_ids, None)
        return logits, partial(eval_loss_func, labels, loss_mask)

    return eval_step


def _collective_device() -> torch.device:
    """Where the default process group can reduce: the accelerator (NCCL/MCCL take device
    tensors only), or the CPU under gloo."""
    return get_accelerator().device()


def _reduce_eval(records: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Mean eval loss over microbatches and exact-match accuracy, the same on every rank."""
    reporter = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and (
        parallel_state.get_tensor_model_parallel_rank() == 0
    )
    value = torch.zeros(4, dtype=torch.float64, device=_collective_device())
    if reporter and records:
        value[0] = sum(float(r["eval loss"]) for r in records)
        value[1] = len(records)
        value[2] = sum(float(r["correct"]) for r in records)
        value[3] = sum(float(r["rows"]) for r in records)
    if dist.is_initialized():
        dist.all_reduce(value)
    out = {"eval/loss": float(value[0] / value[1].clamp(min=1))}
    if value[3] > 0:
        out["eval/accuracy"] = float(value[2] / value[3])
    return out


def _reduce_loss(losses: list[dict[str, torch.Tensor]]) -> float:
    """The step's mean loss, the same on every rank (averaged over DP on the last stage)."""
    reporter = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and (
        parallel_state.get_tensor_model_parallel_rank() == 0
    )
    value = torch.zeros(2, dtype=torch.float64, device=_collective_device())
    if reporter and losses:
        value[0] = torch.stack([x["lm loss"].double().to(value.device) for x in losses]).mean()
        value[1] = 1.0
    if dist.is_initialized():
        dist.all_reduce(value)
    return float(value[0] / value[1].clamp(min=1))


_NONFINITE_HINT = (
    "Lower train.lr or set train.clip_grad (or check the data), then resume from the last "
    "checkpoint."
)


class Trainer:
    """Builds everything from a config, then ``train()`` runs until ``train.train_iters`` (or
    the first evaluation reaching ``train.stop_at_eval_accuracy``)."""

    def __init__(self, cfg: PretrainConfig, accel: Accelerator, dp_size: int) -> None:
        self.cfg = cfg
        self.accel = accel
        self.dp_size = dp_size
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        t = cfg.train
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * dp_size)
        self.tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model)
        self.run_dir = Path(cfg.run.dir)
        self.save_dir = Path(cfg.checkpoint.save or self.run_dir / "checkpoints")
        #: (folder, iteration) this run loads its weights from, if any
        self.load_from = self._checkpoint_to_load()
        vocab = cfg.model.vocab_size or self.tokenizer.vocab_size
        self.setup = build_training(cfg, accel, vocab, self.load_from)
        self.tf, self.model = self.setup.tf, self.setup.model
        self.optimizer, self.scheduler = self.setup.optimizer, self.setup.scheduler
        self.vocab_size = self.setup.vocab_size
        self.annotator = MicrobatchAnnotator([unwrap(c) for c in self.model])
        #: parallel.p2p_transport: the schedules' p2p_communicator (+ groups), or nothing
        self.p2p_kwargs = p2p_schedule_kwargs(cfg, self.tf, accel.device())
        if self.p2p_kwargs:
            self._say(f"pipeline P2P over Mooncake ({self.p2p_kwargs['p2p_communicator']})")
        #: MoE: tokens per expert per layer each step (the expert bias, when enabled, is
        #: updated by megatron's finalize_model_grads, the schedules' finalize hook)
        self.moe_load: MoELoadTracker | None = None
        if cfg.model.num_moe_experts:
            chunks = [unwrap(c) for c in self.model]
            m = cfg.model
            self.moe_load = MoELoadTracker(chunks, m.num_layers, m.num_moe_experts, accel.device())
        self.step = 0
        self.consumed_samples = 0
        #: the latest eval/accuracy (kept in checkpoints for train.stop_at_eval_accuracy)
        self.eval_accuracy: float | None = None
        #: the stop signal that ended ``train()`` (None: it ran to its end)
        self.stopped_by: int | None = None

    # ---- checkpoints ---------------------------------------------------------------
    def _checkpoint_to_load(self) -> CheckpointSource | None:
        """The run's own latest checkpoint (a resume), else ``checkpoint.pretrained_checkpoint``'s
        latest (initial weights only), else None (a new model)."""
        ck = self.cfg.checkpoint
        load_dir = Path(ck.load) if ck.load else self.save_dir
        iteration = latest_iteration(load_dir) if ck.auto_resume else None
        if iteration is not None:  # a release checkpoint is weights only (Megatron-LM's rule)
            return CheckpointSource(load_dir, iteration, resume=iteration != RELEASE)
        if ck.pretrained_checkpoint:
            root = Path(ck.pretrained_checkpoint)
            it = latest_iteration(root)
            if it is None:
                raise FileNotFoundError(
                    f"checkpoint.pretrained_checkpoint {root} holds no complete checkpoint "
                    f"(no {root}/latest_checkpointed_iteration.txt)"
                )
            return CheckpointSource(root, it, resume=False)
        return None

    def maybe_resume(self) -> None:
        src = self.load_from
        if src is None:
            return
        common = self.setup.load(src)
        if src.resume:
            self.step = int(common["step"])
            self.consumed_samples = int(common["consumed_samples"])
            self.eval_accuracy = common.get("eval_accuracy")
            self._say(f"resumed from {src.root} at step {self.step}")
        else:
            self._say(f"initialized weights from {src.root} ({iteration_name(src.iteration)})")

    def save(self) -> None:
        check_params(self.model, f"step {self.step}: checkpoint refused", _NONFINITE_HINT)
        common: dict[str, Any] = {
            "consumed_samples": self.consumed_samples,
            "config": self.cfg.model_dump(mode="json"),
            "eval_accuracy": self.eval_accuracy,
        }
        self.setup.save(self.save_dir, self.step, common, self.cfg.checkpoint.keep_last)
        self._say(f"saved checkpoint {self.save_dir}/iter_{self.step:07d}")

    # ---- training ------------------------------------------------------------------
    def data_iterators(self, dataset) -> list:  # noqa: ANN001
        t = self.cfg.train
        dp_rank = parallel_state.get_data_parallel_rank()
        its = [
            microbatches(
                dataset,
                t.micro_batch_size,
                self.num_microbatches,
                dp_rank,
                self.dp_size,
                self.consumed_samples,
            )
            for _ in self.model
        ]
        return its if len(its) > 1 else its[0]

    @megatron_scope()
    def train_step(self, data_iterator) -> tuple[float, float | None]:  # noqa: ANN001
        t = self.cfg.train
        if self.moe_load is not None:
            self.moe_load.reset()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        schedule_range = (
            torch.profiler.record_function("titan/schedule")
            if self.annotator.active
            else contextlib.nullcontext()
        )
        with schedule_range:
            losses = get_forward_backward_func()(
                forward_step_func=make_forward_step(self.accel.device(), self.annotator),
                data_iterator=data_iterator,
                model=self.model if len(self.model) > 1 else self.model[0],
                num_microbatches=self.num_microbatches,
                seq_length=self.cfg.model.seq_length,
                micro_batch_size=t.micro_batch_size,
                decoder_seq_length=self.cfg.model.seq_length,
                forward_only=False,
                **self.p2p_kwargs,
            )
        check_loss_and_grads(
            self.model, [x["lm loss"] for x in losses], f"step {self.step}", _NONFINITE_HINT,
            check_grads=not t.fp16,  # the fp16 loss scaler skips a step with inf gradients
        )  # fmt: skip
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=t.global_batch_size)
        return _reduce_loss(losses), (float(grad_norm) if grad_norm is not None else None)

    def evaluate(self, dataset) -> dict[str, float]:  # noqa: ANN001
        """``train.eval_iters`` global batches of the validation set, forward only."""
        t = self.cfg.train
        for chunk in self.model:
            chunk.eval()
        records: list[dict[str, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for i in range(t.eval_iters):
                    data = [
                        microbatches(
                            dataset,
                            t.micro_batch_size,
                            self.num_microbatches,
                            parallel_state.get_data_parallel_rank(),
                            self.dp_size,
                            i * t.global_batch_size,
                        )
                        for _ in self.model
                    ]
                    with megatron_scope():
                        records += get_forward_backward_func()(
                            forward_step_func=make_eval_step(self.accel.device()),
                            data_iterator=data if len(data) > 1 else data[0],
                            model=self.model if len(self.model) > 1 else self.model[0],
                            num_microbatches=self.num_microbatches,
                            seq_length=self.cfg.model.seq_length,
                            micro_batch_size=t.micro_batch_size,
                            decoder_seq_length=self.cfg.model.seq_length,
                            forward_only=True,
                            **self.p2p_kwargs,
                        )
        finally:
            for chunk in self.model:
                chunk.train()
        return _reduce_eval(records)

    def _target_met(self) -> bool:
        target = self.cfg.train.stop_at_eval_accuracy
        return target is not None and (self.eval_accuracy or 0.0) >= target

    def train(self, signals: StopSignals | None = None) -> list[dict[str, Any]]:
        """Train to ``train.train_iters`` (or the accuracy target); with ``signals``, a stop
        signal ends the run after the current step, saved (``stopped_by`` is then set)."""
        cfg, t = self.cfg, self.cfg.train
        self.maybe_resume()
        target = t.stop_at_eval_accuracy
        if self._target_met():
            self._say(
                f"nothing to do: eval accuracy {self.eval_accuracy:.3f} at step {self.step} "
                f"already meets train.stop_at_eval_accuracy={target}"
            )
            return []
        remaining = t.train_iters - self.step
        valid_samples = t.eval_iters * t.global_batch_size if t.eval_interval else 0
        train_ds, valid_ds = build_gpt_datasets(
            cfg,
            self.tokenizer,
            max(remaining, 1) * t.global_batch_size + self.consumed_samples,
            valid_samples,
        )
        if t.eval_interval and valid_ds is None:
            raise ValueError(
                "train.eval_interval needs a validation split; give data.split a nonzero "
                "second part (e.g. 98,2,0)"
            )
        data = self.data_iterators(train_ds)
        if self.rank == 0:  # a run killed after its last checkpoint repeats the steps since
            drop_records_after(self.run_dir / "metrics.jsonl", self.step)
        writer = MetricsWriter(self.run_dir / "metrics.jsonl", enabled=self.rank == 0)
        profiler = StepProfiler(
            cfg.profile, cfg.run.dir, self.rank, self.accel.profiler_activities()
        )
        tokens_per_step = t.global_batch_size * cfg.model.seq_length
        history = []
        if self.step >= t.train_iters:
            self._say(f"nothing to do: already at step {self.step} of {t.train_iters}")
        elif target is not None:
            self._say(
                f"training until eval accuracy >= {target} (train.stop_at_eval_accuracy), "
                f"evaluating every {t.eval_interval} steps, at most {t.train_iters} steps"
            )
        try:
            signum = self._agreed_stop(signals)
            if signum is not None:  # during start-up: nothing new to save
                self._stop_on_signal(signum, new_step=False)
                return history
            for self.step in range(self.step + 1, t.train_iters + 1):  # noqa: B020
                with profiler.step(self.step), self.annotator.step(profiler.active(self.step)):
                    self.accel.synchronize()
                    start = time.perf_counter()
                    loss, grad_norm = self.train_step(data)
                    self.accel.synchronize()
                    elapsed = time.perf_counter() - start
                self.consumed_samples += t.global_batch_size
                record = {
                    "step": self.step,
                    "loss": loss,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_step / elapsed,
                    "step_time_s": elapsed,
                    "consumed_samples": self.consumed_samples,
                }
                if self.moe_load is not None:  # a collective: every rank, every step
                    record.update(self.moe_load.collect())
                if t.eval_interval and (
                    self.step % t.eval_interval == 0 or self.step == t.train_iters
                ):
                    record.update(self.evaluate(valid_ds))
                    self.eval_accuracy = record.get("eval/accuracy")
                history.append(record)
                writer.write(record)
                if self.step % t.log_interval == 0 or "eval/loss" in record:
                    self._say(format_status(record, t.train_iters))
                interval = cfg.checkpoint.save_interval
                stop = "eval/accuracy" in record and self._target_met()
                saved = False
                if (interval and self.step % interval == 0) or self.step == t.train_iters or stop:
                    self.save()
                    saved = True
                if stop:
                    self._say(
                        f"eval accuracy {self.eval_accuracy:.3f} >= "
                        f"train.stop_at_eval_accuracy={target}: stopped at step {self.step} "
                        f"(cap {t.train_iters})"
                    )
                    break
                if self.step < t.train_iters:
                    signum = self._agreed_stop(signals)
                    if signum is not None:
                        self._stop_on_signal(signum, new_step=True, saved=saved)
                        break
            else:
                if target is not None and self.step == t.train_iters:
                    self._say(
                        f"reached train.train_iters={t.train_iters} with eval accuracy "
                        f"{self.eval_accuracy or 0.0:.3f}, below "
                        f"train.stop_at_eval_accuracy={target}; raise train.train_iters "
                        "and run again to train on"
                    )
        finally:
            writer.close()
            profiler.close()
        return history

    # ---- stop signals (preemption) --------------------------------------------------
    def _agreed_stop(self, signals: StopSignals | None) -> int | None:
        """The stop signal's number if any rank got one. Every rank calls this at the same
        step: under torchrun one rank may get SIGTERM before the others, or alone, and all
        must stop (and save) at the same step."""
        if signals is None:
            return None
        signum = signals.requested or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            # one MAX all-reduce of signum * world + (world - 1 - rank): the highest signal
            # number and, of the ranks that got it, the lowest (named if it is not rank 0)
            world = dist.get_world_size()
            mine = signum * world + (world - 1 - self.rank) if signum else 0
            flag = torch.tensor([mine], dtype=torch.int64, device=_collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = int(flag.item())
            signum = agreed // world
            by = world - 1 - agreed % world
            if signum and by != 0:
                self._say(f"{signal_name(signum)} came to {describe_rank(by)}: every rank stops")
        return signum or None

    def _stop_on_signal(self, signum: int, new_step: bool, saved: bool = False) -> None:
        """Save the step just completed (``checkpoint.save_on_signal``) and say how to go on."""
        if new_step and not saved and self.cfg.checkpoint.save_on_signal:
            self.save()
            saved = True
        self.stopped_by = signum
        where = f"at step {self.step}" if new_step else f"before step {self.step + 1}"
        if saved:
            state, action = f"saved {iteration_dir(self.save_dir, self.step).name}", "resume"
        else:
            last = latest_iteration(self.save_dir)
            state = "not saved (checkpoint.save_on_signal=false)" if new_step else "nothing new"
            state += (
                f", last checkpoint {iteration_dir(self.save_dir, last)}"
                if last is not None
                else ", no checkpoint yet"
            )
            action = "resume from it" if last is not None else "start over"
        self._say(
            f"stopped by {signal_name(signum)} {where}; {state}; rerun the same command to {action}"
        )

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)
