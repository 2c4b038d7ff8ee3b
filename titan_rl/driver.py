"""The GRPO driver's step phases, one call each, as titan_rl/grpo.py's loop runs them:

    rollout -> (colocated: engines release) train -> (resume) sync -> eval -> record -> save

The driver runs over the job's parts (titan_rl/job.py) and holds what lives across steps:
the prefetched rollout (async), the step timer, the profiled steps, and the progress a stop
signal saves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_core.training.metrics import read_metrics
from titan_rl.actors.recovery import EngineLostError
from titan_rl.config import GRPOConfig
from titan_rl.plot import plot_rewards
from titan_rl.step_log import status_line, step_record
from titan_rl.step_timer import StartupTimer, StepTimer
from titan_rl.stopping import lost_line, stopped_line, until_stopped
from titan_rl.trainer.batch import pack_samples

if TYPE_CHECKING:
    from titan_rl.job import Job
    from titan_rl.rollout.generate import RolloutResult


@dataclass
class Progress:
    """Where the run stands: what a stop signal saves and reports (titan_rl/stopping.py)."""

    start: int  #: the step the run resumed at (0: a fresh start)
    completed: int  #: the last step whose policy update finished
    sampler: dict[str, int]  #: the prompt sampler's state after ``completed``
    #: the groups carried to the next rollout after ``completed`` (rollout.partial)
    carried: list[dict[str, Any]]
    saved: int | None  #: the newest checkpoint's step


class Driver:
    """A GRPO run's steps over the job's trainer group and engines (through its client)."""

    def __init__(self, cfg: GRPOConfig, job: Job) -> None:
        missing = [
            name
            for name in ("aio", "trainers", "engines", "writer", "recovery", "colocation")
            if getattr(job, name) is None
        ]
        if missing:
            raise RuntimeError(f"the job has no {', '.join(missing)} yet: Job.start builds them")
        self.cfg = cfg
        rollouts = self.rollouts = job.rollouts
        self.recovery = job.recovery
        self.trainers = job.trainers
        self.engines = job.engines
        self.client = job.client
        self.colocation = job.colocation
        self.writer = job.writer
        self.aio: asyncio.AbstractEventLoop = job.aio
        self.stop = job.stop
        self.timer = StepTimer()
        resumed_at = job.resumed_at
        start = resumed_at or 0
        self.progress = Progress(
            start, start, rollouts.sampler.state(), rollouts.carried.state(), resumed_at
        )
        self._pending: RolloutResult | None = None  # the next step's, drawn while training
        self._first: dict[str, Any] = dict(rollouts.data_stats)  # goes with the first record
        steps = cfg.profile.steps
        self._profiled = set(range(min(steps, default=0), max(steps, default=-1) + 1))
        self._report: Future[None] | None = None  # reward.png, drawn once the steps are done

    @property
    def steps(self) -> range:
        """The steps this run has left."""
        return range(self.progress.start + 1, self.cfg.run.num_steps + 1)

    @property
    def stopped(self) -> bool:
        """A stop signal came: no step starts any more."""
        return self.stop.requested is not None

    def _until_stopped(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return until_stopped(self.aio, coro, self.stop)

    def _take_first(self) -> dict[str, Any]:
        first, self._first = self._first, {}
        return first

    @contextmanager
    def _marked(self, phase: str, on: bool) -> Iterator[None]:
        """A ``titan/rl/<phase>`` range in the trainers' traces (profiled steps)."""
        if on:
            self.trainers.mark(phase, True)
        yield
        if on:
            self.trainers.mark(phase, False)

    def startup(self, timer: StartupTimer) -> None:
        """Report the start-up's phases: one line, and ``time/startup*`` in the first step's record."""
        self._first.update(timer.metrics())
        print(timer.line(), flush=True)

    def evaluate_base(self) -> None:
        """A fresh run's held-out accuracy before any update: the record of step 0 (none
        with ``run.eval_interval`` null)."""
        if self.progress.start != 0 or self.cfg.run.eval_interval is None:
            return
        acc = self._until_stopped(self.rollouts.evaluate(self.client, self.recovery))
        if acc is not None:
            self.writer.write({"step": 0, "eval/accuracy": acc, **self._take_first()})
            print(f"step    0 | eval acc {acc:.3f} (before RL)", flush=True)

    def begin_step(self, step: int) -> None:
        if step in self._profiled:
            self.trainers.begin_step(step)
        self.timer.start()

    def rollout(self, step: int) -> RolloutResult | None:
        """The step's samples (async: those drawn while the previous step trained); None
        when a stop signal came, which abandons the step before its policy update."""
        with self.timer.phase("rollout"):
            result, self._pending = self._pending, None
            if result is None:
                mark = step in self._profiled and not self.cfg.rollout.async_rollout
                with self._marked("rollout", mark):
                    result = self._until_stopped(
                        self.rollouts.rollout(self.client, step, self.recovery)
                    )
        return None if self.stopped else result

    def train(self, step: int, result: RolloutResult) -> dict[str, float]:
        """The policy update on the step's samples. Async rollout: the next step's rollout
        runs meanwhile on the current weights (one step off-policy; importance ratios
        against the rollout logprobs correct for it)."""
        with self.timer.phase("train"):
            batch = pack_samples(result.samples, self.rollouts.tok.eod)
            sampler = self.rollouts.sampler
            if self.cfg.rollout.async_rollout and step < self.cfg.run.num_steps:
                update = self.trainers.train_async(batch, step)
                self.recovery.on_train_queued(str(step))  # what a resync would now send
                # a resume redraws what the prefetch draws, and continues what it continues
                after, carried = sampler.state(), self.rollouts.carried.state()
                try:
                    self._pending = self._until_stopped(
                        self.rollouts.rollout(self.client, step + 1, self.recovery)
                    )
                except EngineLostError:  # the update in flight is the step's: it completes
                    update.result()
                    self._completed(step, after, carried)
                    raise
                metrics = update.result()
            else:
                metrics = self.trainers.train(batch, step)
                after, carried = sampler.state(), self.rollouts.carried.state()
        self._completed(step, after, carried)
        return metrics

    def _completed(self, step: int, sampler: dict[str, int], carried: list[Any]) -> None:
        """``step``'s policy update finished; the prompt sampler and the carried groups are
        as they stood after drawing it."""
        self.progress.completed, self.progress.sampler = step, sampler
        self.progress.carried = carried

    @contextmanager
    def recorded_if_engines_lost(
        self, step: int, result: RolloutResult, metrics: dict[str, float]
    ) -> Iterator[None]:
        """Engines lost for good after the step's policy update finished (the engines'
        wait after training, the sync): the step is recorded, with the ``metrics`` it got so
        far, before the loss stops the run (its checkpoint is that step)."""
        try:
            yield
        except EngineLostError:
            if self.progress.completed == step:
                self.record(step, result, metrics)
            raise

    def sync(self, step: int) -> dict[str, float]:
        """The new weights to every engine (their version: the step)."""
        with self.timer.phase("sync"):
            metrics = self.trainers.sync_weights(step)
            self.recovery.on_sync(str(step))
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """``eval/accuracy`` every ``run.eval_interval`` steps and at the last one (never
        with ``run.eval_interval`` null)."""
        every = self.cfg.run.eval_interval
        with self.timer.phase("eval"):
            if every is None or (step % every and step != self.cfg.run.num_steps):
                return {}
            acc = self._until_stopped(self.rollouts.evaluate(self.client, self.recovery))
        return {} if acc is None else {"eval/accuracy": acc}

    def record(self, step: int, result: RolloutResult, measured: dict[str, float]) -> None:
        """Close the step: its times, the engines' health, its record and status line."""
        rec = step_record(step, result, {**measured, **self.timer.stop()})
        lost = None
        try:
            rec.update(self.aio.run_until_complete(self.recovery.report()))
        except EngineLostError as e:  # the step is done: recorded first, then the stop
            lost = e
        if "engines/restarts" not in rec:  # the report's supervision counts them
            rec["engines/restarts"] = self.engines.restarts()
        if step in self._profiled:
            self.trainers.end_step(step)
        self.writer.write({**rec, **self._take_first()})
        if step % self.cfg.run.log_interval == 0 or "eval/accuracy" in rec:
            print(status_line(rec, self.cfg.run.num_steps), flush=True)
        if lost is not None:
            raise lost

    def save(self, step: int) -> None:
        """A checkpoint every ``run.save_interval`` steps and at the last one (0: only at the
        last; null: never, though a stop signal still saves with ``run.save_on_signal``)."""
        every = self.cfg.run.save_interval
        if every is None:
            return
        if (every and step % every == 0) or step == self.cfg.run.num_steps:
            self._save(step)

    def _save(self, step: int) -> None:
        self.trainers.save(
            step, {"sampler": self.progress.sampler, "partial": self.progress.carried}
        )
        self.progress.saved = step

    def engines_lost(self, error: EngineLostError) -> int:
        """Engines lost for good (their node, or their supervisor gave up): the last completed
        step saved (``run.save_on_signal``), one line saying what was lost and how to go on;
        exit code 1."""
        p, run = self.progress, self.cfg.run
        if run.save_on_signal and p.completed > p.start and p.saved != p.completed:
            self._save(p.completed)
        print(
            lost_line(error, p.completed, p.start, p.saved, self.rollouts.run_dir / "checkpoints"),
            flush=True,
        )
        return 1

    def finish(self) -> int:
        """0 once every step ran (the reward plot written); after a stop signal, 128 + signum,
        the last completed step saved (``run.save_on_signal``) and the line saying so."""
        p, run = self.progress, self.cfg.run
        run_dir = self.rollouts.run_dir
        if self.stop.requested is not None and p.completed < run.num_steps:
            if run.save_on_signal and p.completed > p.start and p.saved != p.completed:
                self._save(p.completed)
            line = stopped_line(
                self.stop.requested, p.completed, p.start, p.saved, run_dir / "checkpoints",
                run.save_on_signal,
            )  # fmt: skip
            print(line, flush=True)
            return self.stop.exit_code
        self._report = ThreadPoolExecutor(1, thread_name_prefix="reward-plot").submit(
            plot_rewards, read_metrics(run_dir / "metrics.jsonl"), run_dir / "reward.png"
        )  # drawn while the job's engines, trainers and Ray stop
        return 0

    def report_written(self) -> None:
        """Once :meth:`finish` returned 0: wait for ``reward.png`` and say what was written."""
        if self._report is None:
            return
        self._report.result()
        run_dir = self.rollouts.run_dir
        print(f"wrote {run_dir / 'metrics.jsonl'} and {run_dir / 'reward.png'}", flush=True)
