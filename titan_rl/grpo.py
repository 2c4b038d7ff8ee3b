"""``python -m titan_rl.grpo --config examples/math.yaml [key.sub=value ...] [--dry-run]``

GRPO on Titan's training base: Megatron trainer actors and SGLang-API rollout engines
(the built-in engine on CPU), driven by Ray. One step:

    prompts -> n responses each (engines) -> rewards -> trainer: old/ref logprobs,
    advantages, policy update(s) -> weight sync -> eval every eval_interval -> checkpoint
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import TYPE_CHECKING

from titan_core.config import ConfigError, load_config
from titan_core.run_lock import RunLock
from titan_rl.config import GRPOConfig
from titan_rl.placement import placement_plan
from titan_rl.preflight import check_config, check_machine, learning_warnings

if TYPE_CHECKING:
    from titan_core.signals import StopSignals
    from titan_rl.driver import Driver

EXIT_CONFIG_ERROR = 2


def ensure_base_checkpoint(cfg: GRPOConfig) -> None:
    """Pretrain the base policy with titan_core.pretrain if it is not there yet, or train it
    on if its held-out accuracy is below its pretraining config's target."""
    from titan_rl.base_policy import ensure_base_policy

    ensure_base_policy(cfg.policy)


def resolve_config(cfg: GRPOConfig) -> GRPOConfig:
    """Reject mode combinations the loop cannot run and fill the defaults that depend on
    other keys (``algo.use_tis``, ``sync.resume_kv_cache``, ``rollout.return_routed_experts``
    under ``algo.routing_replay``); idempotent."""
    if cfg.rollout.async_rollout and cfg.engines.colocate:
        raise ConfigError(
            "rollout.async=true cannot run with engines.colocate=true: async rollout generates "
            "while the trainer trains, but colocated engines release their memory for training; "
            "set rollout.async=false or engines.colocate=false"
        )
    if cfg.sync.resume_kv_cache and not cfg.engines.colocate:
        raise ConfigError(
            "sync.resume_kv_cache=true is for colocated engines (their KV cache is released "
            "while training); set engines.colocate=true or leave sync.resume_kv_cache unset"
        )
    algo, sync = cfg.algo, cfg.sync
    if algo.use_tis is None:  # one-step off-policy samples need the importance correction
        algo = algo.model_copy(update={"use_tis": cfg.rollout.async_rollout})
    if sync.resume_kv_cache is None:
        sync = sync.model_copy(update={"resume_kv_cache": cfg.engines.colocate})
    rollout = cfg.rollout
    if algo.routing_replay and not rollout.return_routed_experts:  # replay needs them
        rollout = rollout.model_copy(update={"return_routed_experts": True})
    return cfg.model_copy(update={"algo": algo, "sync": sync, "rollout": rollout})


def run(cfg: GRPOConfig) -> int:
    """The job: 0 once done; 128 + signum when SIGTERM / SIGINT stopped it (after saving its
    last completed step, see titan_rl.stopping)."""
    from titan_core.signals import Stopped, StopSignals

    with StopSignals() as stop:
        try:
            return _run(cfg, stop)
        except Stopped as e:  # the base policy's pretraining, which the signal stopped
            print(e.message, flush=True)
            return e.exit_code


def _run(cfg: GRPOConfig, stop: StopSignals) -> int:
    import ray

    from titan_core.signals import exit_code, ignoring
    from titan_core.training.metrics import MetricsWriter
    from titan_rl.actors.engine_actor import RolloutEngineGroup
    from titan_rl.colocation import Colocation, colocation_for
    from titan_rl.driver import Driver
    from titan_rl.placement import init_ray, machine_plan, ray_init_kwargs, reserve
    from titan_rl.rollout import ClientOptions, RetryPolicy, make_engine_client
    from titan_rl.rollouts import Rollouts
    from titan_rl.start_weights import clear_start_dir, link_policy, serves_policy_files
    from titan_rl.step_log import open_metrics
    from titan_rl.step_timer import StartupTimer
    from titan_rl.trainer.group import TrainerGroup

    startup = StartupTimer()
    cfg = resolve_config(cfg)
    # a dataset error or an impossible layout stops the run before any pretraining
    loop = Rollouts(cfg)
    plan = machine_plan(cfg)
    ensure_base_checkpoint(cfg)
    if stop.requested is not None:
        print(f"stopped by {stop.name} before RL started; rerun the same command", flush=True)
        return stop.exit_code
    startup.ended("prepare")  # the config, the prompts, the plan, the base policy
    owns_ray = not ray.is_initialized()
    if owns_ray:
        try:
            with ignoring(signal.SIGINT):  # Ray's processes leave Ctrl-C to this job
                init_ray(**ray_init_kwargs(cfg.ray, plan))
        except SystemExit:  # SIGTERM while Ray started: its handler, not ours, got it
            ray.shutdown()
            print("stopped by SIGTERM while Ray started; rerun the same command", flush=True)
            return exit_code(signal.SIGTERM)
    stop.install()  # ray.init replaced our SIGTERM handler with its own
    startup.ended("ray")
    placement = reserve(plan)
    trainers = TrainerGroup(cfg, placement)  # builds in its actors; threads: plan.threads
    engines = None
    writer: MetricsWriter | None = None
    colocation: Colocation | None = None
    aio = asyncio.new_event_loop()
    code = 0
    e = cfg.engines
    try:
        # a fresh run from an HF policy: the engines serve its files while the trainers build
        # (colocated on devices, the trainer takes its memory first, as SGLang sizes by it)
        side_by_side = not e.colocate or plan.accelerator == "cpu"
        if side_by_side and serves_policy_files(cfg):
            link_policy(cfg, loop.tok)
            engines = RolloutEngineGroup(placement.engine_launches("0"), plan.router)
            url = engines.start()
            startup.ended("engines")
        trainers.ready()
        startup.ended("trainers")
        resumed = trainers.resume()
        start = 0
        if resumed:
            start = int(resumed["step"])
            loop.sampler.restore(resumed["sampler"])
            loop.carried.restore(resumed.get("partial", []))
            print(f"resumed from {loop.run_dir / 'checkpoints'} at step {start}", flush=True)
        writer = open_metrics(loop.run_dir / "metrics.jsonl", start if resumed else -1)
        if engines is None:
            # the engines as the plan resolved them, serving the trainer's weights of `start`
            trainers.save_hf(str(clear_start_dir(cfg)))
            engines = RolloutEngineGroup(placement.engine_launches(str(start)), plan.router)
            url = engines.start()
            startup.ended("engines")
        trainers.connect_engines(engines.urls)
        loop.recovery = engines.recovery(trainers.resync_engines, e.retry_timeout_s, e.client)
        client = make_engine_client(url, ClientOptions(
            api_key=e.api_key, max_concurrency=cfg.rollout.max_concurrency,
            retry=RetryPolicy(timeout_s=e.retry_timeout_s),
        ), client=e.client)  # fmt: skip
        colocation = colocation_for(
            e.colocate, engines.urls, e.api_key, cfg.sync.resume_kv_cache,
            aio.run_until_complete, loop.recovery.wait_all_up, e.client,
        )  # fmt: skip
        driver = Driver(
            cfg, loop, trainers, engines, client, colocation, writer, aio, stop,
            resumed_at=start if resumed else None,
        )  # fmt: skip
        startup.ended("connect")
        driver.evaluate_base()
        startup.ended("eval")
        driver.startup(startup)
        _train(driver)
        code = driver.finish()
        aio.run_until_complete(client.aclose())
    finally:
        with contextlib.ExitStack() as cleanup:  # every step runs, even after one raised
            if owns_ray:
                cleanup.callback(ray.shutdown)  # the actors' processes, and their children
            cleanup.callback(aio.close)
            cleanup.callback(trainers.shutdown)
            cleanup.callback(loop.reward.close)
            cleanup.callback(_close_tool_workers)
            if engines is not None:
                cleanup.callback(engines.stop)
            if writer is not None:
                cleanup.callback(writer.close)
            if loop.recovery is not None:
                cleanup.callback(lambda: aio.run_until_complete(loop.recovery.aclose()))
            if colocation is not None:
                cleanup.callback(colocation.close)
    return code


def _close_tool_workers() -> None:
    """Stop the worker processes of tools with isolation="process" (rollout hooks' tools)."""
    from titan_rl.rollout.tools import close_tool_workers

    close_tool_workers()


def _train(driver: Driver) -> None:
    """The steps, as slime's train.py reads: rollout, train, sync, eval, save."""
    for step in driver.steps:
        if driver.stopped:
            break
        driver.begin_step(step)
        result = driver.rollout(step)  # None: a stop signal abandoned the step
        if result is None:
            break
        with driver.colocation.around_training(driver.timer):  # colocated: release / resume
            metrics = driver.train(step, result)
        metrics |= driver.sync(step)
        metrics |= driver.evaluate(step)
        driver.record(step, result, metrics)
        driver.save(step)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m titan_rl.grpo", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--config", help="YAML config (see examples/math.yaml)")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the placement plan")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = ap.parse_args(argv)
    from titan_rl.data import DatasetError

    try:
        cfg = resolve_config(load_config(GRPOConfig, args.config, args.overrides))
        check_config(cfg)  # all a user can get wrong, before anything starts
        for line in learning_warnings(cfg):
            print(f"warning: {line}", file=sys.stderr)
        if args.dry_run:
            print("\n".join(placement_plan(cfg)))
            return 0
        check_machine(cfg)  # what running here needs (a dry run may plan another machine)
        with RunLock(cfg.run.dir):  # one job per run.dir, or exit 2 before Ray starts
            return run(cfg)
    except (ConfigError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
