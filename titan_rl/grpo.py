"""``python -m titan_rl.grpo --config examples/math.yaml [key.sub=value ...] [--dry-run]``

GRPO on Titan's training base: Megatron trainer actors and SGLang-API rollout engines
(the built-in engine on CPU), driven by Ray. One step:

    prompts -> n responses each (engines) -> rewards -> trainer: old/ref logprobs,
    advantages, policy update(s) -> weight sync -> eval every eval_interval -> checkpoint
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from titan_core import startup_gc
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
    from titan_rl.base_policy import ensure_base_policy  # the job's, not the CLI's import

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
    dist = sync.distributed
    if (
        cfg.ray.address
        and sync.transport == "distributed"  # another's section must keep its defaults
        and "master_address" not in dist.model_fields_set
    ):
        # on a cluster the engines may be on other nodes: loopback would not reach the sender
        auto = dist.model_copy(update={"master_address": "auto"})
        sync = sync.model_copy(update={"distributed": auto})
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
        except Stopped as e:  # before RL started (the base policy's pretraining, Ray's start)
            print(e.message, flush=True)
            return e.exit_code


def _run(cfg: GRPOConfig, stop: StopSignals) -> int:
    # Ray, the actors and the job's parts: imported by the job, not by the CLI's parsing
    from titan_rl.actors.recovery import EngineLostError
    from titan_rl.driver import Driver
    from titan_rl.job import Job
    from titan_rl.step_timer import StartupTimer

    startup_gc.imported()  # torch's and Ray's objects; the settle after start-up collects the rest
    startup = StartupTimer()
    cfg = resolve_config(cfg)
    job = Job.start(cfg, stop, startup)  # prepare, ray, engines / trainers side by side
    code, driver = 0, None
    try:
        driver = Driver(cfg, job)
        startup.ended("connect")
        try:
            driver.evaluate_base()
            startup.ended("eval")
            startup_gc.settle()  # the start-up's objects out of the steps' collections
            startup.ended("settle")
            driver.startup(startup)
            _train(driver)
            code = driver.finish()
        except EngineLostError as e:  # for good: saved, said, exit 1
            code = driver.engines_lost(e)
    finally:
        job.close()
    if driver is not None and code == 0:
        driver.report_written()
    return code


def _train(driver: Driver) -> None:
    """The steps, as slime's train.py reads: rollout, train, sync, eval, save."""
    for step in driver.steps:
        if driver.stopped:
            break
        driver.begin_step(step)
        result = driver.rollout(step)  # None: a stop signal abandoned the step
        if result is None:
            break
        metrics: dict[str, float] = {}
        with driver.recorded_if_engines_lost(step, result, metrics):
            with driver.colocation.around_training(driver.timer):  # colocated: release / resume
                metrics |= driver.train(step, result)
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
    with startup_gc.paused():  # the driver's start-up settles it (_run)
        return _main(args)


def _main(args: argparse.Namespace) -> int:
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
    from titan_core.process_exit import exit_process

    exit_process(main())
