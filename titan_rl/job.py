"""A GRPO run's parts, built from its config in one place, and their teardown.

:meth:`Job.start` builds them in start-up order, ending each ``time/startup/<phase>`` as it
completes: ``prepare`` (the prompts, the tokenizer, the reward) and ``ray`` side by side where
they can be (a ready base policy: the prompts are made on a thread while Ray's processes
start; a base to pretrain first: a dataset error stops the run before any pretraining, and
Ray starts after both), then the trainers and the engines side by side where they can be (a
fresh run from an HF policy: the engines serve its files while the trainers build; otherwise
they start once the trainers have resumed, on the trainers' weights of that step), then the
connections: the trainers to the engines, the engines' recovery, the rollout client, the
colocation. :meth:`Job.close` tears down what was built, newest first, every step even after
one raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray

from titan_core.config import ConfigError
from titan_core.signals import Stopped, StopSignals, ignoring
from titan_core.training.metrics import MetricsWriter
from titan_rl.actors.engine_actor import RolloutEngineGroup
from titan_rl.actors.recovery import EngineRecovery
from titan_rl.base_policy import base_training, ensure_base_policy
from titan_rl.colocation import Colocation, colocation_for
from titan_rl.config import GRPOConfig
from titan_rl.nodes import NodeWatch
from titan_rl.placement import (
    Placement,
    PlacementPlan,
    init_ray,
    machine_plan,
    ray_init_kwargs,
    reserve,
    shutdown_local_ray,
)
from titan_rl.rollout import ClientOptions, EngineClient, RetryPolicy, make_engine_client
from titan_rl.rollout.tools import close_tool_workers
from titan_rl.rollouts import Rollouts
from titan_rl.start_weights import clear_start_dir, link_policy, serves_policy_files
from titan_rl.step_log import open_metrics
from titan_rl.step_timer import StartupTimer
from titan_rl.sync.transports import TRANSPORTS
from titan_rl.trainer.group import TrainerGroup


@dataclass(eq=False)
class Job:
    """What :class:`~titan_rl.driver.Driver` runs the steps over; a part not built yet is
    None (:meth:`close` tears down what is there)."""

    #: the stop signals of the run (the driver reads them between steps)
    stop: StopSignals
    #: the prompts, the tokenizer, the reward: what rollouts and evals send to the engines
    rollouts: Rollouts
    #: the driver's event loop
    aio: asyncio.AbstractEventLoop | None = None
    trainers: TrainerGroup | None = None
    engines: RolloutEngineGroup | None = None
    #: the metrics file, opened after the resume (a resumed run drops the records after it)
    writer: MetricsWriter | None = None
    #: gives restarted engines the current weights
    recovery: EngineRecovery | None = None
    #: the rollouts' client (through the router)
    client: EngineClient | None = None
    colocation: Colocation | None = None
    #: the step the run resumed at (None: a fresh start)
    resumed_at: int | None = None
    #: this job started Ray, and shuts it down
    owns_ray: bool = False
    #: the nodes the job's actors run on, watched (a lost one is said within seconds)
    watch: NodeWatch | None = None

    @classmethod
    def start(cls, cfg: GRPOConfig, stop: StopSignals, startup: StartupTimer) -> Job:
        """Every part of the run ``cfg`` (resolved), up to the connections. Raises
        :class:`~titan_core.signals.Stopped` when a stop signal came before RL started."""
        plan = machine_plan(cfg)
        owns_ray = not ray.is_initialized()
        if owns_ray and _base_ready(cfg):
            rollouts = _prepare_while_ray_starts(cfg, plan, stop, startup)
        else:
            # a dataset error stops the run before any pretraining (or the base's own error)
            rollouts = Rollouts(cfg)
            ensure_base_policy(cfg.policy)
            _raise_if_stopped(stop)
            startup.ended("prepare")  # the config, the prompts, the plan, the base policy
            if owns_ray:
                _start_ray(cfg, plan)
            stop.install()  # ray.init replaced our SIGTERM handler with its own
            startup.ended("ray")
        job = cls(stop, rollouts, owns_ray=owns_ray)
        placement = reserve(plan)
        _check_nodes(cfg, placement)
        job.watch = placement.watch()  # asked when engines stop answering
        if cfg.ray.address is not None:  # a cluster: which node holds what, watched from now
            print(job.watch.placed(), flush=True)
            job.watch.start()
        job.trainers = TrainerGroup(cfg, placement)  # builds in its actors; threads: plan.threads
        job.aio = asyncio.new_event_loop()
        try:
            job._connect(cfg, plan, placement, startup)
        except BaseException as error:
            try:
                job.close()
            except Exception as also:  # said, but the error that stopped the start is raised
                print(f"while stopping after {type(error).__name__}: {type(also).__name__}: "
                      f"{also}", file=sys.stderr, flush=True)  # fmt: skip
            raise
        return job

    def _connect(
        self, cfg: GRPOConfig, plan: PlacementPlan, placement: Placement, startup: StartupTimer
    ) -> None:
        """The engines, the resume, the metrics file and the connections between the parts."""
        assert self.trainers is not None and self.aio is not None
        rollouts, trainers, e = self.rollouts, self.trainers, cfg.engines
        # a fresh run from an HF policy: the engines serve its files while the trainers build
        # (colocated on devices, the trainer takes its memory first, as SGLang sizes by it)
        side_by_side = not e.colocate or plan.accelerator == "cpu"
        if side_by_side and serves_policy_files(cfg):
            link_policy(cfg, rollouts.tok)
            self.engines = RolloutEngineGroup(
                placement.engine_launches("0"), plan.router, self.watch
            )
            url = self.engines.start()
            startup.ended("engines")
        trainers.ready()
        startup.ended("trainers")
        resumed = trainers.resume()
        start = 0
        if resumed:
            start = int(resumed["step"])
            rollouts.sampler.restore(resumed["sampler"])
            rollouts.carried.restore(resumed.get("partial", []))
            print(f"resumed from {rollouts.run_dir / 'checkpoints'} at step {start}", flush=True)
            self.resumed_at = start
        self.writer = open_metrics(rollouts.run_dir / "metrics.jsonl", start if resumed else -1)
        if self.engines is None:
            # the engines as the plan resolved them, serving the trainer's weights of `start`
            trainers.save_hf(str(clear_start_dir(cfg)))
            self.engines = RolloutEngineGroup(
                placement.engine_launches(str(start)), plan.router, self.watch
            )
            url = self.engines.start()
            startup.ended("engines")
        print(self.engines.describe(), flush=True)
        # sync.transport=mooncake without sync.mooncake.agents: the agents beside the engines
        trainers.connect_engines(self.engines.urls, self.engines.agent_urls())
        self.recovery = self.engines.recovery(trainers.resync_engines, e.retry_timeout_s, e.client)
        self.client = make_engine_client(url, ClientOptions(
            api_key=e.api_key, max_concurrency=cfg.rollout.max_concurrency,
            retry=RetryPolicy(timeout_s=e.retry_timeout_s),
        ), client=e.client)  # fmt: skip
        self.colocation = colocation_for(
            e.colocate, self.engines.urls, e.api_key, cfg.sync.resume_kv_cache,
            self.aio.run_until_complete, self.recovery.wait_all_up, e.client,
        )  # fmt: skip

    def close(self) -> None:
        """Tear down what was built, newest first; every step runs, even after one raised."""
        aio = self.aio
        with contextlib.ExitStack() as cleanup:
            if self.owns_ray:
                cleanup.callback(shutdown_local_ray)  # the actors' processes, and their children
            if self.watch is not None:
                cleanup.callback(self.watch.stop)
            if aio is not None:
                cleanup.callback(aio.close)
            if self.trainers is not None:
                cleanup.callback(self.trainers.shutdown)
            cleanup.callback(self.rollouts.reward.close)
            cleanup.callback(close_tool_workers)  # tools with isolation="process"
            if self.engines is not None:
                cleanup.callback(self.engines.stop)
            if self.writer is not None:
                cleanup.callback(self.writer.close)
            recovery, client = self.recovery, self.client
            if aio is not None and recovery is not None:
                cleanup.callback(lambda: aio.run_until_complete(recovery.aclose()))
            if self.colocation is not None:
                cleanup.callback(self.colocation.close)
            if aio is not None and client is not None:
                cleanup.callback(lambda: aio.run_until_complete(client.aclose()))


def _raise_if_stopped(stop: StopSignals) -> None:
    if stop.requested is not None:
        raise Stopped(
            stop.requested, f"stopped by {stop.name} before RL started; rerun the same command"
        )


def _start_ray(cfg: GRPOConfig, plan: PlacementPlan) -> None:
    """This job's Ray (its processes leave Ctrl-C to this job); Stopped when SIGTERM came
    while it started."""
    try:
        with ignoring(signal.SIGINT):
            init_ray(**ray_init_kwargs(cfg.ray, plan))
    except SystemExit:  # SIGTERM while Ray started: its handler, not ours, got it
        ray.shutdown()
        raise Stopped(
            signal.SIGTERM, "stopped by SIGTERM while Ray started; rerun the same command"
        ) from None


def _base_ready(cfg: GRPOConfig) -> bool:
    """The base policy is there and good enough: nothing is pretrained before RL starts (a
    base that cannot be used is said after the dataset's checks, as one to pretrain)."""
    try:
        return base_training(cfg.policy) is None
    except ConfigError:
        return False


def _prepare_while_ray_starts(
    cfg: GRPOConfig, plan: PlacementPlan, stop: StopSignals, startup: StartupTimer
) -> Rollouts:
    """The prompts, the tokenizer and the reward (:class:`Rollouts`: transformers' import, the
    chat template: about a second of one core) made on a thread while this job's Ray starts,
    which mostly waits for its processes and leaves a core to spare. A dataset error is raised
    once Ray is shut down again. Only where the base policy is ready (nothing is pretrained
    before RL starts, which a dataset error must stop first)."""
    with ThreadPoolExecutor(1, thread_name_prefix="titan-prepare") as pool:
        made = pool.submit(Rollouts, cfg)
        _start_ray(cfg, plan)  # raising: the pool waits for the thread, its result is dropped
        stop.install()  # ray.init replaced our SIGTERM handler with its own
        startup.ended("ray")
        try:
            rollouts = made.result()
            _raise_if_stopped(stop)
        except BaseException:
            ray.shutdown()
            raise
    startup.ended("prepare")  # what the prompts, the tokenizer took beyond Ray's start
    return rollouts


def _check_nodes(cfg: GRPOConfig, placement: Placement) -> None:
    """ConfigError where the transport needs the engines on a trainer's node and Ray placed
    some elsewhere (the placement group is removed first)."""
    apart = placement.engines_apart()
    if apart and TRANSPORTS[cfg.sync.transport].same_node:
        placement.remove()
        raise ConfigError(
            f"sync.transport={cfg.sync.transport}: the engines open the weights the trainer "
            f"shares in its node's memory, but Ray placed {', '.join(apart)}, where no trainer "
            "rank runs; use sync.transport=distributed, disk (on a folder every node sees) or "
            "mooncake, or place the engines with the trainer (ray.engine_resources)"
        )
