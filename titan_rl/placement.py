"""Where the GRPO job's actors run: ``ray.init`` arguments, the placement plan, its group.

One Ray placement group of per-device bundles, as slime lays it out: ``{"GPU": 1, "CPU": 1}``
per device on GPU accelerators, ``{"CPU": 1}`` on CPU. Trainer rank r sits on slot r; engine
i (``engines.tp_size`` = t devices) spans t consecutive slots: the trainer's own when
colocated (each actor takes a share of the device), the slots after the trainer's when
disaggregated. A slot is a bundle once the bundles are ordered by (node, device id).

:func:`plan_placement` computes and validates the layout without Ray (what ``--dry-run``
prints); :func:`reserve` creates the placement group and finds each bundle's node and device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_core.config import ConfigError
from titan_core.net import NODE_IP_ENV
from titan_rl.actors.config import (
    EngineLaunch,
    PlacedEngine,
    RouterConfig,
    engine_problem,
    resolve_backend,
)
from titan_rl.config import EnginesConfig, GRPOConfig, RayConfig
from titan_rl.nodes import DRIVER_DIR_ENV, NodeWatch, RayNode, ray_nodes

#: Colocated shares of one device (slime's): a trainer rank and an engine fit one bundle.
TRAINER_SHARE_COLOCATED = 0.4
ENGINE_SHARE = 0.2


@dataclass(frozen=True)
class RankCoords:
    """A trainer rank in Megatron's grid (dense: tp, cp, dp, pp; experts: etp, ep, edp, pp)."""

    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


def rank_coords(rank: int, world: int, tp: int, cp: int, pp: int, ep: int, etp: int) -> RankCoords:
    """Coordinates in megatron-core's default rank order ``tp-cp-ep-dp-pp`` (tp fastest).

    The dense grid has no ep and the expert grid no cp, as megatron's two RankGenerators.
    """
    dp = world // (tp * cp * pp)
    edp = world // (etp * ep * pp)
    return RankCoords(
        tp=rank % tp,
        cp=rank // tp % cp,
        dp=rank // (tp * cp) % dp,
        pp=rank // (tp * cp * dp),
        etp=rank % etp,
        ep=rank // etp % ep,
        edp=rank // (etp * ep) % edp,
    )


# ---- threads ---------------------------------------------------------------------------------
#: how long an idle OpenMP thread of the trainer and engine processes spins for the next
#: parallel region before it sleeps (``GOMP_SPINCOUNT``, set where the user has set neither it
#: nor ``OMP_WAIT_POLICY``): 30,000 iterations of libgomp's wait, ~0.4 ms here. A step's ops
#: follow each other within microseconds, so a team that sleeps at once (``PASSIVE``) pays a
#: wake-up per op: bench/vs_trl.py's M=32 trainer 75 -> 65 ms a step at 2 threads. libgomp's
#: own default (300,000, ~4 ms) holds a core that long after each phase, and on cores shared
#: with another process a spinning thread takes the time slices its team's late thread needs;
#: bench/cpu_sharing.py beside a busy process: 1.60x the quiet step (PASSIVE 1.42x, both under
#: the 2x of the lost core), quiet 0.678 s against PASSIVE's 0.733 s.
SPIN_COUNT = 30_000
#: the user's settings of the OpenMP wait, left as they are
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's cpuset, taskset),
    which may be fewer than the machine's ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS (macOS)
        return os.cpu_count() or 1


def omp_num_threads(environ: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` (its first level, as OpenMP reads ``"4,2"``), None where unset."""
    raw = environ.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ConfigError(
            f"OMP_NUM_THREADS={raw!r}: give a positive number of threads, or unset it "
            "(trainer.num_threads and engines.num_threads set them per process)"
        )
    return int(first)


@dataclass(frozen=True)
class Threads:
    """The torch (OpenMP) threads of each trainer process and each engine, resolved once
    (:func:`resolve_threads`), and the environment those processes start with."""

    #: threads of each trainer process
    trainer: int
    #: threads of each engine, shared by its TP ranks (titan_rl/engine/tp/comm.py)
    engine: int
    #: where each came from: the key, "OMP_NUM_THREADS" or "auto"
    trainer_from: str
    engine_from: str
    #: auto: the cores counted, and whether trainer and engines compute at the same time
    cores: int
    at_once: bool
    #: ``GOMP_SPINCOUNT`` given to the processes (None: the user's own settings stand)
    spin_count: int | None
    #: auto: the trainer trains while the engines (beside it) wait, as in a sync rollout
    trainer_alone: bool = False

    def env(self, threads: int) -> dict[str, str]:
        """The environment of a process running ``threads`` threads (set before torch
        loads: OpenMP reads it once, when its library loads)."""
        env = {"OMP_NUM_THREADS": str(threads)}
        if self.spin_count is not None:
            env["GOMP_SPINCOUNT"] = str(self.spin_count)
        return env

    def describe(self) -> str:
        line = (
            f"threads: {self.trainer} per trainer process ({self.trainer_from}), "
            f"{self.engine} per engine ({self.engine_from})"
        )
        if "auto" in (self.trainer_from, self.engine_from):
            line += f"; auto: the {self.cores} core(s) this job may use, " + (
                "split between the trainer processes and the engines (side by side)"
                if self.at_once
                else "for each phase (generation and training alternate)"
            )
            if self.trainer_alone:  # only ever set with at_once
                line += ", the trainer's all of them (it trains while the engines wait)"
        if self.spin_count is not None:
            return (
                line + f"; GOMP_SPINCOUNT={self.spin_count} (idle threads spin ~0.4 ms, then sleep)"
            )
        return line + "; OpenMP wait: the user's OMP_WAIT_POLICY / GOMP_SPINCOUNT"


def resolve_threads(
    trainer_threads: int | None,
    engine_threads: int | None,
    trainer_processes: int,
    num_engines: int,
    engine_tp: int,
    at_once: bool,
    cores: int | None = None,
    environ: Mapping[str, str] | None = None,
    trainer_alone: bool = False,
) -> Threads:
    """The threads of each trainer process and engine: the keys where set, else
    ``OMP_NUM_THREADS``, else auto from ``cores`` (default: :func:`available_cores`).

    Auto: where generation and training alternate (``at_once`` false: colocated engines)
    each phase has every core, shared by the processes computing in it. Where they compute
    at the same time each trainer process and engine TP rank gets an equal share (at least
    one; the cores left over go to the trainer processes). More threads than free cores
    stall: every parallel region waits for its slowest thread, and a thread whose core
    another process holds waits for its time slice. The one place these defaults live (the
    GRPO job's placement plan and the slime / miles adapters' engines call it).

    ``trainer_alone`` (engines beside the trainer, a sync rollout): the trainer trains while
    the engines wait, so its processes share every core; the engines keep their side-by-side
    share, as a decode step's small matmuls lose more to a second thread's synchronisation
    than they gain on CPU (bench/vs_trl.py's model, M=128 on 2 cores: a step 0.84 -> 0.65-0.69
    s with the trainer at 2 threads; the rollout 0.35-0.39 -> 0.88-1.08 s with the engine's).
    With idle threads spinning (:data:`SPIN_COUNT`) the engine's second thread gains on a quiet
    machine (a sync step 209 -> 185 ms at M=32), but a decode step's ~60 small ops each wait
    for both threads: under its host's load, 2 of the bench's 4 sync runs with the engine at
    2 threads collapsed (M=32 0.91 s a step against 0.38 s in the other run; M=128 7.8 s
    against 1.8 s) while TRL's, alternating with them, did not."""
    environ = os.environ if environ is None else environ
    cores = cores or available_cores()
    omp = omp_num_threads(environ)
    if at_once:
        slots = trainer_processes + num_engines * engine_tp
        share = max(1, cores // slots)
        trainer_auto = share + max(0, cores - share * slots) // trainer_processes
        engine_auto = share * engine_tp
        if trainer_alone:
            trainer_auto = max(1, cores // trainer_processes)
    else:
        trainer_auto = max(1, cores // trainer_processes)
        engine_auto = max(1, cores // num_engines)

    def pick(key: int | None, name: str, auto: int) -> tuple[int, str]:
        if key is not None:
            return key, name
        if omp is not None:
            return omp, "OMP_NUM_THREADS"
        return auto, "auto"

    trainer, trainer_from = pick(trainer_threads, "trainer.num_threads", trainer_auto)
    engine, engine_from = pick(engine_threads, "engines.num_threads", engine_auto)
    user_wait = any(environ.get(k) for k in WAIT_SETTINGS)
    return Threads(
        trainer, engine, trainer_from, engine_from, cores, at_once,
        None if user_wait else SPIN_COUNT, trainer_alone and at_once,
    )  # fmt: skip


def job_threads(cfg: GRPOConfig) -> Threads:
    """The GRPO job's threads. Disaggregated engines sit beside the trainer (their own
    bundles) and with ``rollout.async`` generate while it trains: the cores are split, so
    neither's threads wait on the other's; without it (a sync rollout) the trainer trains
    while they wait and takes every core, the engines keeping their share. Colocated engines
    (never async) take turns with the trainer: each phase gets every core."""
    e = cfg.engines
    return resolve_threads(
        cfg.trainer.num_threads, e.num_threads, cfg.trainer.num_processes, e.num_engines,
        e.tp_size,
        at_once=not e.colocate or cfg.rollout.async_rollout,
        trainer_alone=not e.colocate and not cfg.rollout.async_rollout,
    )  # fmt: skip


@dataclass(frozen=True)
class PlacementPlan:
    """The layout of one GRPO job, before anything starts."""

    accelerator: str
    #: the Ray resource of one device ("GPU"); None: bundles of CPU only.
    resource: str | None
    #: the engines' backend, ``auto`` resolved
    backend: str
    colocate: bool
    #: the router in front of the engines (None: none)
    router: RouterConfig | None
    trainer_processes: int
    #: tensor, pipeline, context, expert, expert-tensor and data parallel sizes.
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    num_engines: int
    engine_tp: int
    #: devices (CPU slots) Ray will offer, when known before it starts.
    available: int | None
    address: str | None
    #: every engine's launch, resolved (each engine's base_gpu_id and the start-up weight
    #: version are set when they start); None where this machine cannot launch them
    engine: EngineLaunch | None = None
    #: why this machine cannot launch the engines (a GPU plan shown on a CPU machine)
    unlaunchable: str | None = None
    #: the trainer processes' and engines' threads (None: not resolved, a bare plan)
    threads: Threads | None = None
    #: custom Ray resources each trainer / engine bundle asks for too (``ray.*_resources``)
    trainer_resources: Mapping[str, float] = field(default_factory=dict)
    engine_resources: Mapping[str, float] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return self.resource or "CPU slot"

    @property
    def num_bundles(self) -> int:
        return self.trainer_processes + self.engine_bundles

    @property
    def engine_bundles(self) -> int:
        """The bundles after the trainer's: the engines' own (none when colocated)."""
        return 0 if self.colocate else self.num_engines * self.engine_tp

    @property
    def bundle(self) -> dict[str, float]:
        """A bundle's CPU and device (each role's custom resources on top: :meth:`bundles`)."""
        return {self.resource: 1, "CPU": 1} if self.resource else {"CPU": 1}

    @property
    def by_role(self) -> bool:
        """The trainer's and the engines' bundles ask for different resources (placed apart)."""
        return bool(self.trainer_resources or self.engine_resources)

    def bundles(self) -> list[dict[str, float]]:
        """Every bundle of the group, the trainer's first."""
        trainer = {**self.bundle, **self.trainer_resources}
        engine = {**self.bundle, **self.engine_resources}
        return [trainer] * self.trainer_processes + [engine] * self.engine_bundles

    @property
    def trainer_share(self) -> float:
        return TRAINER_SHARE_COLOCATED if self.colocate else 1.0

    def engine_slots(self, index: int) -> range:
        """The slots engine ``index`` spans."""
        first = (0 if self.colocate else self.trainer_processes) + index * self.engine_tp
        return range(first, first + self.engine_tp)

    def coords(self, rank: int) -> RankCoords:
        return rank_coords(
            rank, self.trainer_processes, self.tp, self.cp, self.pp, self.ep, self.etp
        )

    def describe(self) -> list[str]:
        """The plan in words: which actor on which slot, and why it fits."""
        unit = self.unit
        mode = (
            f"colocated: trainer ranks and engines share the bundles (a trainer rank takes "
            f"{TRAINER_SHARE_COLOCATED} of one, an engine {ENGINE_SHARE})"
            if self.colocate
            else "disaggregated: the engines take the bundles after the trainer's"
        )
        if self.available is not None:
            have = f"{self.available} available"
        elif self.address is not None:
            have = f"checked against the cluster at {self.address} when it starts"
        elif self.resource is None:
            have = "a local Ray sized to fit"
        else:
            have = f"this machine ({self.accelerator}) has none; needs a {self.resource} machine"
        roles = ""
        if self.by_role:
            roles = (
                f"; the trainer's also ask for {dict(self.trainer_resources) or 'nothing more'}"
                f" (ray.trainer_resources), the engines' for "
                f"{dict(self.engine_resources) or 'nothing more'} (ray.engine_resources)"
            )
        lines = [
            f"placement: one Ray placement group of {self.num_bundles} bundle(s) "
            f"{self.bundle} (PACK); {mode}{roles}",
            f"devices: {self.num_bundles} {unit}(s) needed, {have}"
            + ("; GPU k = the k-th bundle by (node, device id)" if self.resource else ""),
            f"trainer: {self.trainer_processes} Megatron process(es) = TP{self.tp} x PP{self.pp}"
            f" x CP{self.cp} x DP{self.dp}"
            + (f", EP{self.ep} (expert TP{self.etp})" if self.ep > 1 else "")
            + (
                "; a whole bundle each"
                if not self.colocate
                else f"; {self.trainer_share} of one each"
            ),
        ]
        for rank in range(self.trainer_processes):
            c = self.coords(rank)
            where = f"tp {c.tp}, pp {c.pp}, dp {c.dp}"
            if self.cp > 1:
                where += f", cp {c.cp}"
            if self.ep > 1:
                where += f", ep {c.ep}"
            lines.append(f"  rank {rank} -> {unit} {rank}: {where}")
        lines.append(
            f"engines: {self.num_engines} x {self.backend} (tp {self.engine_tp}), "
            f"{ENGINE_SHARE} of their first bundle each"
            + (", behind sglang-router" if self.router else "")
        )
        for i in range(self.num_engines):
            s = self.engine_slots(i)
            span = f"{unit} {s[0]}" if len(s) == 1 else f"{unit}s {s[0]}..{s[-1]}"
            if self.resource:
                span += f" (base_gpu_id: the device id of {unit} {s[0]} on its node)"
            lines.append(f"  engine {i} -> {span}")
        agent = self.engine.mooncake_agent if self.engine is not None else None
        if agent is not None:
            lines.append(
                f"mooncake: each engine's actor starts an agent beside it, a {agent.buffer_bytes}"
                f"-byte receive buffer over {agent.protocol} (sync.mooncake.agents unset)"
            )
        if self.threads is not None:
            lines.append(self.threads.describe())
        return lines


def _engines_error(e: EnginesConfig, problem: tuple[str, str]) -> str:
    key, why = problem
    return f"engines.{key}={getattr(e, key)}: {why}"


def engine_launch(
    cfg: GRPOConfig,
    accelerator: str,
    threads: Threads,
    model_path: str,
    log_dir: str | None = None,
    sglang_args: Sequence[str] = (),
) -> EngineLaunch:
    """What each engine runs, resolved: the one place an engines section becomes a launch, for
    the GRPO job's placement plan and the slime / miles adapters' engines alike.

    From ``cfg``: ``engines.*`` (the backend resolved for ``accelerator``; colocated engines
    run with the memory saver) and ``rollout.return_routed_experts``; from the plan: the
    engines' ``threads``, what they serve (``model_path``: the weights and the tokenizer,
    so that stop texts match), where they log (None: a temporary folder) and flags for
    SGLang servers only (``sglang_args``: the built-in engine would refuse them). With
    ``sync.transport=mooncake`` and no ``sync.mooncake.agents``, each engine's actor starts a
    Mooncake agent beside it, a buffer region per trainer sender (each pipeline stage's; on
    MoE models each EP rank's: titan_core.models.hf.SendRole).
    """
    e, p = cfg.engines, cfg.parallel
    backend = resolve_backend(e.backend, accelerator)
    senders = p.pipeline_model_parallel_size * (
        p.expert_model_parallel_size if cfg.model.num_moe_experts else 1
    )
    agent = cfg.sync.mooncake.job_agent(cfg.sync.bucket_bytes, senders)
    return EngineLaunch(
        model_path=model_path, backend=backend, device=accelerator,
        tp_size=e.tp_size, mem_fraction_static=e.mem_fraction_static,
        enable_memory_saver=e.colocate, api_key=e.api_key,
        num_threads=threads.engine,
        env=threads.env(threads.engine) if backend == "builtin" else {},  # SGLang: its own
        log_dir=log_dir, dtype=e.dtype,
        chunked_prefill_size=e.chunked_prefill_size,
        health_timeout_s=e.health_timeout_s,
        enable_return_routed_experts=cfg.rollout.return_routed_experts,
        extra_args=list(sglang_args) if backend == "sglang" else [],
        mooncake_agent=agent if cfg.sync.transport == "mooncake" else None,
    )  # fmt: skip


def plan_placement(
    cfg: GRPOConfig, accelerator: str, resource: str | None, devices: int | None
) -> PlacementPlan:
    """Lay out and validate the job; ``devices``: how many ``resource`` devices Ray will have
    (None: unknown). Raises ConfigError naming the key of an impossible layout."""
    n, p, e = cfg.trainer.num_processes, cfg.parallel, cfg.engines
    cfg.pretrain_view(n)  # the trainer's config: layers / heads / experts / batch vs layout
    dp = n // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    dp //= p.context_parallel_size

    backend = resolve_backend(e.backend, accelerator)
    if backend == "sglang":
        resource = resource or "GPU"  # SGLang's layout, even where this machine cannot run it
    if (problem := engine_problem(backend, e.tp_size, None)) is not None:
        raise ConfigError(_engines_error(e, problem))
    here = engine_problem(backend, e.tp_size, accelerator)
    engine_devices = e.num_engines * e.tp_size
    if e.colocate and engine_devices > n:
        raise ConfigError(
            f"engines.colocate=true: engines.num_engines x engines.tp_size ({e.num_engines} x "
            f"{e.tp_size} = {engine_devices}) exceeds trainer.num_processes ({n}), the devices the "
            "colocated engines share; lower engines.num_engines or raise trainer.num_processes"
        )
    if e.colocate and cfg.ray.engine_resources:
        raise ConfigError(
            "ray.engine_resources with engines.colocate=true: colocated engines share the "
            "trainer's bundles (placed by ray.trainer_resources); drop ray.engine_resources "
            "or set engines.colocate=false"
        )
    available = devices if resource else cfg.ray.num_cpus
    run_dir = Path(cfg.run.dir)
    logs = str(run_dir / "logs")
    threads = job_threads(cfg)
    # the engines serve the start-up weights the trainer writes to <run.dir>/hf_start (with
    # the run's tokenizer beside them) and log to <run.dir>/logs
    launch = None  # where this machine cannot launch them (a GPU plan on a CPU machine)
    if here is None:
        launch = engine_launch(cfg, accelerator, threads, str(run_dir / "hf_start"), logs)
    plan = PlacementPlan(
        accelerator=accelerator,
        resource=resource,
        backend=backend,
        colocate=e.colocate,
        router=RouterConfig(log_dir=logs) if e.router else None,
        trainer_processes=n,
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        cp=p.context_parallel_size,
        ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
        dp=dp,
        num_engines=e.num_engines,
        engine_tp=e.tp_size,
        available=available,
        address=cfg.ray.address,
        engine=launch,
        unlaunchable=None if here is None else _engines_error(e, here),
        threads=threads,
        trainer_resources=dict(cfg.ray.trainer_resources),
        engine_resources=dict(cfg.ray.engine_resources),
    )
    if available is not None and plan.num_bundles > available:
        raise ConfigError(f"{_need(plan)}, but only {available} are available ({_source(plan)})")
    if resource and cfg.ray.num_cpus is not None and plan.num_bundles > cfg.ray.num_cpus:
        raise ConfigError(
            f"ray.num_cpus={cfg.ray.num_cpus}: the placement group needs one CPU per bundle "
            f"({plan.num_bundles}); raise ray.num_cpus or leave it unset"
        )
    return plan


def _need(plan: PlacementPlan) -> str:
    if plan.colocate:
        return (
            f"trainer.num_processes={plan.trainer_processes} needs {plan.num_bundles} "
            f"{plan.unit}(s)"
        )
    return (
        f"trainer.num_processes + engines.num_engines x engines.tp_size = "
        f"{plan.trainer_processes} + {plan.num_engines} x {plan.engine_tp} = "
        f"{plan.num_bundles} {plan.unit}(s) "
        "(disaggregated; engines.colocate=true shares the trainer's)"
    )


def _source(plan: PlacementPlan) -> str:
    if plan.resource is None:
        return "ray.num_cpus"
    return f"this machine's {plan.accelerator} devices"


def machine_plan(cfg: GRPOConfig, launching: bool = True) -> PlacementPlan:
    """:func:`plan_placement` for this machine's accelerator (its device count counts only for
    a local Ray; an existing cluster's is checked when the job starts). ``launching``: the
    job runs here, so engines this machine cannot launch are a ConfigError (``--dry-run``
    shows such a plan)."""
    from titan_core.accelerator import get_accelerator

    accel = get_accelerator()
    devices = None
    if accel.ray_resource and cfg.ray.address is None:
        devices = accel.device_count()
    plan = plan_placement(cfg, accel.name, accel.ray_resource, devices)
    if launching and plan.unlaunchable is not None:
        raise ConfigError(plan.unlaunchable)
    return plan


def placement_plan(cfg: GRPOConfig) -> list[str]:
    """What would run where, for ``--dry-run`` (validates the layout first)."""
    from titan_core.accelerator import get_accelerator

    accel = get_accelerator()
    plan = machine_plan(cfg, launching=False)
    lines = [
        f"accelerator: {accel.name} (process groups: {accel.communication_backend()}, "
        f"weight sync: {cfg.sync.transport}"
        + (
            f" over {accel.weight_update_backend()})"
            if cfg.sync.transport == "distributed"
            else ")"
        ),
        "ray: " + _ray_line(cfg.ray),
        *plan.describe(),
        f"policy: {cfg.policy.format} weights from {cfg.policy.load}",
        f"batch: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n_samples_per_prompt} "
        f"samples, {cfg.train.ppo_steps} update(s) per step, {cfg.run.num_steps} steps",
        f"run dir: {cfg.run.dir}",
    ]
    return lines


#: the niceness of a local Ray's worker processes, the trainer ranks and the engines (and
#: the servers they start). Ray's default, 15, keeps its raylet and GCS ahead of its
#: workers, but it also puts every process at the default niceness ahead of them: one
#: ``python -c "while True: pass"`` on a shared core takes ~30x their share of it (weights
#: 1024 and 36), and a 2-thread trainer rank's every parallel region waits for its thread
#: there. ``RAY_worker_niceness``, where set, stands.
WORKER_NICENESS = 0
#: Ray's variable of its workers' niceness (Ray's spelling: its system settings' names)
NICENESS_ENV = "RAY_worker_niceness"
#: Ray's variable of its prestart of workers for the first driver. A local Ray starts with it
#: off: Ray would start an idle worker per CPU as the driver connects, which the trainer
#: actors cannot use (their environment, the plan's threads, is their own runtime_env) and,
#: on an accelerator, neither can the engines' (its visible-devices variable). Each is a
#: Python process importing Ray (~0.4 CPU-s) at the busiest moment of the start; on a GPU
#: node, one per CPU. bench/vs_trl.py's job on 2 cores: start-up 12.2-14.7 s instead of
#: 12.8-15.2 s (3 alternating pairs, 0.5-0.6 s less in each). Where set, it stands.
PRESTART_ENV = "RAY_prestart_worker_first_driver"


def worker_niceness() -> int | None:
    """The niceness a local Ray gives its workers here (None: the user's
    ``RAY_worker_niceness``)."""
    return None if os.environ.get(NICENESS_ENV) else WORKER_NICENESS


def local_ray_settings() -> dict[str, Any]:
    """The system settings a local Ray starts with: its workers' niceness
    (:data:`WORKER_NICENESS`) and no workers prestarted (:data:`PRESTART_ENV`), each where the
    user has not set Ray's own variable of it."""
    settings: dict[str, Any] = {}
    niceness = worker_niceness()
    if niceness is not None:
        settings["worker_niceness"] = niceness
    if not os.environ.get(PRESTART_ENV):
        settings["prestart_worker_first_driver"] = False
    return settings


def _ray_line(ray_cfg: RayConfig) -> str:
    if ray_cfg.address:
        return (
            f"existing cluster at {ray_cfg.address} (its workers' niceness is the cluster's: "
            "Ray's default 15 unless it started with RAY_worker_niceness)"
        )
    niceness = worker_niceness()
    if niceness is None:
        return f"local, workers at niceness {os.environ[NICENESS_ENV]} ({NICENESS_ENV})"
    return f"local, workers at niceness {niceness} (Ray's default: 15)"


def ray_init_kwargs(ray_cfg: RayConfig, plan: PlacementPlan) -> dict[str, Any]:
    """``ray.init`` arguments: a local Ray sized for the plan with its workers at
    :data:`WORKER_NICENESS`, or only the cluster's address (Ray refuses resource arguments
    and system settings when it joins an existing cluster)."""
    common: dict[str, Any] = {"log_to_driver": True, "configure_logging": False}
    if ray_cfg.namespace is not None:
        common["namespace"] = ray_cfg.namespace
    if ray_cfg.address is not None:
        return {"address": ray_cfg.address, **common}
    kwargs: dict[str, Any] = {
        "address": "local",  # a new local Ray, even where RAY_ADDRESS is set
        "num_cpus": ray_cfg.num_cpus or max(2, os.cpu_count() or 1, plan.num_bundles),
        "include_dashboard": False,
        **common,
    }
    if plan.available:  # Ray does not detect every kind (MUSA)
        kwargs.update(_device_request(plan.resource, plan.available))
    settings = local_ray_settings()
    if settings:
        kwargs["_system_config"] = settings
    return kwargs


#: tries of a local Ray's start (see :func:`init_ray`)
RAY_START_TRIES = 3


def init_ray(**kwargs: Any) -> None:
    """``ray.init(**kwargs)``, tried again when a local Ray's node does not register in time.

    Ray waits a fixed 30 s for its raylet to register with the GCS (``ray._private.node``,
    no setting), which a busy machine (2 cores starting trainers and engines) can miss; the
    node then shuts down and a second start usually finds the machine quieter. The processes
    the failed start left (its GCS, dashboard, monitors: Ray forgets them with the node) are
    killed first, so they do not load the next try or outlive the job."""
    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(1, RAY_START_TRIES + 1):
        before = {c.pid for c in me.children()}
        try:
            ray.init(**kwargs)
            return
        except Exception as e:
            ray.shutdown()
            _kill_trees([c for c in me.children() if c.pid not in before])
            if "timed out during startup" not in str(e) or attempt == RAY_START_TRIES:
                raise
            print(f"Ray's node did not start in time ({attempt}/{RAY_START_TRIES}); "
                  "starting it again", flush=True)  # fmt: skip


#: the command line of a local Ray's autoscaler monitor (``ray/autoscaler/_private``)
_RAY_MONITOR = "autoscaler/_private/monitor.py"


def shutdown_local_ray() -> None:
    """``ray.shutdown()`` of the Ray this process started, without its 1 s wait on the
    autoscaler monitor.

    ``ray.shutdown`` stops the node's processes one by one, the GCS before the monitor, and
    gives each a 1 s grace after SIGTERM. The monitor's SIGTERM handler reports its "failure"
    to the GCS, which is gone by then, so it spends the whole second (1.0 of the 1.4 s
    shutdown here). A local job's monitor has no nodes to scale and holds no state, so it is
    SIGKILLed first; ``ray.shutdown`` then finds it gone and stops the rest as before."""
    import psutil
    import ray

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any(_RAY_MONITOR in arg for arg in child.cmdline()):
                child.kill()
                child.wait(timeout=5)
    ray.shutdown()


def _kill_trees(procs: list[Any]) -> None:
    """SIGKILL these processes and their descendants (psutil processes)."""
    import psutil

    every = [d for p in procs for d in _with_descendants(p)]
    for p in every:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(every, timeout=5)


def _with_descendants(proc: Any) -> list[Any]:
    import psutil

    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def _device_request(resource: str | None, amount: float) -> dict[str, Any]:
    """``amount`` of a ``resource`` device in Ray's arguments (``num_gpus`` for "GPU")."""
    if resource is None:
        return {}
    if resource == "GPU":
        return {"num_gpus": amount}
    return {"resources": {resource: amount}}


# ---- the placement group (needs a running Ray) --------------------------------------------
@dataclass(frozen=True)
class Slot:
    """One bundle of the group: its index, its node (on a running Ray) and on device bundles
    its device id."""

    bundle: int
    node_ip: str | None = None
    device: int | None = None
    #: the Ray node holding the bundle (None: not looked up, a plan without Ray)
    node: RayNode | None = None


@dataclass(frozen=True)
class EnginePlacement:
    """Where one engine actor goes (what ``RolloutEngineGroup`` hands to ``.options()``)."""

    actor_options: dict[str, Any]
    #: SGLang's --base-gpu-id: the first device of the engine's span (None on CPU bundles).
    base_gpu_id: int | None
    #: bind the server to its node's IP (an existing cluster: the driver may be elsewhere).
    bind_node_ip: bool
    #: the Ray node of its first bundle (None: not looked up)
    node: RayNode | None = None

    def place(self, launch: EngineLaunch) -> PlacedEngine:
        """``launch`` on this placement: its base_gpu_id and node IP binding, and the actor's
        options."""
        update: dict[str, Any] = {"bind_node_ip": self.bind_node_ip}
        if self.base_gpu_id is not None:
            update["base_gpu_id"] = self.base_gpu_id
        return PlacedEngine(launch.model_copy(update=update), self.actor_options, self.node)


def _where(resource: str) -> tuple[str, int]:
    """Inside a task on one bundle: (node IP, device id)."""
    import ray

    ids = ray.get_runtime_context().get_accelerator_ids()[resource]
    return ray.util.get_node_ip_address(), int(ids[0])


def _probe(pg: Any, plan: PlacementPlan) -> list[Slot]:
    """Every bundle's node and device, in (node, device) order (slime's InfoActor pass)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resource = plan.resource
    assert resource is not None
    task = ray.remote(_where)
    refs = [
        task.options(
            num_cpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i
            ),
            **_device_request(resource, 1),
        ).remote(resource)
        for i in range(plan.num_bundles)
    ]
    found = [Slot(i, ip, dev) for i, (ip, dev) in enumerate(ray.get(refs))]
    # rank r on the r-th device by (node, id); where the trainer's and the engines' bundles
    # ask for different nodes (by_role), each role's bundles are ordered among themselves
    engine = lambda s: plan.by_role and s.bundle >= plan.trainer_processes  # noqa: E731
    return sorted(found, key=lambda s: (engine(s), s.node_ip, s.device))


def _with_nodes(pg: Any, slots: list[Slot]) -> list[Slot]:
    """``slots`` with the Ray node each bundle was placed on (Ray's placement-group table: no
    task runs)."""
    from ray.util.placement_group import placement_group_table

    placed = placement_group_table(pg)["bundles_to_node_id"]
    nodes = ray_nodes()
    out = []
    for s in slots:
        node = nodes.get(placed.get(s.bundle, ""))
        ip = s.node_ip or (node.ip if node else None)
        out.append(Slot(s.bundle, ip, s.device, node))
    return out


class Placement:
    """The plan's placement group, reserved: actor options for each trainer rank and engine."""

    def __init__(self, plan: PlacementPlan, pg: Any, slots: list[Slot]) -> None:
        self.plan = plan
        self.pg = pg
        self.slots = slots
        for i in range(plan.num_engines):
            span = [slots[k] for k in plan.engine_slots(i)]
            devices = [s.device for s in span]
            first = devices[0]
            same_node = len({s.node_ip for s in span}) == 1
            if first is not None and (
                not same_node or devices != list(range(first, first + len(span)))
            ):
                raise ConfigError(
                    f"engines.tp_size={plan.engine_tp}: engine {i} would span "
                    f"{[(s.node_ip, s.device) for s in span]}, not consecutive devices of one "
                    "node; use a tp_size that divides each node's device count"
                )

    def _options(
        self, slot: Slot, share: float, env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from titan_core.accelerator import accelerator_named

        opts: dict[str, Any] = {
            "num_cpus": share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=slot.bundle
            ),
        }
        opts.update(_device_request(self.plan.resource, share))
        # Ray leaves the visible devices alone: each actor picks its device by the slot's id
        env = {**accelerator_named(self.plan.accelerator).ray_actor_env(), **(env or {})}
        if self.plan.address is not None:  # a cluster: the actors run from the driver's folder
            env[DRIVER_DIR_ENV] = os.getcwd()
        if env:
            opts["runtime_env"] = {"env_vars": env}
        return opts

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s actor options; its process starts with the plan's thread
        environment (Ray would otherwise set ``OMP_NUM_THREADS`` to its CPU share) and, on a
        cluster, its node's address (``TITAN_NODE_IP``: its gloo groups listen there)."""
        threads = self.plan.threads
        env = dict(threads.env(threads.trainer)) if threads is not None else {}
        slot = self.slots[rank]
        if self.plan.address is not None and slot.node_ip:
            env[NODE_IP_ENV] = slot.node_ip
        return self._options(slot, self.plan.trainer_share, env or None)

    def engine_node(self, index: int) -> RayNode | None:
        """The Ray node engine ``index`` runs on (None: not known)."""
        return self.slots[self.plan.engine_slots(index)[0]].node

    def engines_apart(self) -> list[str]:
        """The engines on a node that holds no trainer rank, in words ("engine 0 on
        127.0.0.3"): they cannot open what a trainer shares in its node's memory."""
        trainer_nodes = {s.node_ip for s in self.slots[: self.plan.trainer_processes]}
        apart = []
        for i in range(self.plan.num_engines):
            node = self.engine_node(i)
            if node is not None and node.ip not in trainer_nodes:
                apart.append(f"engine {i} on {node.ip}")
        return apart

    def watch(self) -> NodeWatch:
        """A watch of the nodes this placement's actors are on."""
        held: dict[RayNode, list[str]] = {}
        for rank in range(self.plan.trainer_processes):
            if (node := self.slots[rank].node) is not None:
                held.setdefault(node, []).append(f"trainer rank {rank}")
        for i in range(self.plan.num_engines):
            if (node := self.engine_node(i)) is not None:
                held.setdefault(node, []).append(f"engine {i}")
        return NodeWatch(held)

    def trainer_local_rank(self, rank: int) -> int:
        """The device a rank uses on its node (its rank on CPU bundles)."""
        device = self.slots[rank].device
        return rank if device is None else device

    def engines(self) -> list[EnginePlacement]:
        out = []
        for i in range(self.plan.num_engines):
            slot = self.slots[self.plan.engine_slots(i)[0]]
            out.append(
                EnginePlacement(
                    actor_options=self._options(slot, ENGINE_SHARE),
                    base_gpu_id=slot.device,
                    bind_node_ip=self.plan.address is not None,
                    node=slot.node,
                )
            )
        return out

    def engine_launches(self, weight_version: str) -> list[PlacedEngine]:
        """Every engine's launch on its placement, serving ``weight_version`` at start-up."""
        if self.plan.engine is None:
            raise ConfigError(self.plan.unlaunchable or "the engines cannot launch here")
        launch = self.plan.engine.model_copy(update={"weight_version": weight_version})
        return [where.place(launch) for where in self.engines()]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def _check_role_resources(plan: PlacementPlan, cluster: Mapping[str, float]) -> None:
    """ConfigError naming the ``ray.*_resources`` key whose resource the cluster lacks (a
    placement group asking for it would wait for ever)."""
    needs: dict[str, float] = {}
    keys: dict[str, str] = {}
    for key, asked, count in (
        ("ray.trainer_resources", plan.trainer_resources, plan.trainer_processes),
        ("ray.engine_resources", plan.engine_resources, plan.engine_bundles),
    ):
        for name, amount in asked.items():
            needs[name] = needs.get(name, 0.0) + amount * count
            keys.setdefault(name, f"{key}.{name}")
    for name, need in needs.items():
        if cluster.get(name, 0.0) < need:
            raise ConfigError(
                f"{keys[name]}: the placement needs {need:g} {name} in all, and the Ray "
                f"cluster has {cluster.get(name, 0.0):g}; start its nodes with ray start "
                f"--resources '{{\"{name}\": N}}', or lower the amount"
            )


def reserve(plan: PlacementPlan) -> Placement:
    """Create the plan's placement group on the running Ray and wait until it is placed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    kind = plan.resource or "CPU"
    cluster = ray.cluster_resources()
    have = int(cluster.get(kind, 0))
    if have < plan.num_bundles:
        raise ConfigError(f"{_need(plan)}, but the Ray cluster has {have} {kind}")
    _check_role_resources(plan, cluster)
    pg = placement_group(plan.bundles(), strategy="PACK")
    try:
        ray.get(pg.ready())
        slots = _probe(pg, plan) if plan.resource else [Slot(i) for i in range(plan.num_bundles)]
        return Placement(plan, pg, _with_nodes(pg, slots))
    except BaseException:
        remove_placement_group(pg)
        raise
