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
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_core.config import ConfigError, load_config
from titan_core.run_lock import RunLock
from titan_rl.config import GRPOConfig
from titan_rl.placement import placement_plan
from titan_rl.preflight import check_base_dir, check_base_matches, learning_warnings

if TYPE_CHECKING:
    from titan_core.signals import StopSignals
    from titan_rl.actors.recovery import EngineRecovery
    from titan_rl.data import PromptSet
    from titan_rl.rollout.generate import VersionCheck
    from titan_rl.rollout.rewarding import SampleRewarder

EXIT_CONFIG_ERROR = 2


def ensure_base_checkpoint(cfg: GRPOConfig) -> None:
    """Pretrain the base policy with titan_core.pretrain if it is not there yet, or train it
    on if its held-out accuracy is below its pretraining config's target."""
    from titan_rl.base_policy import ensure_base_policy

    ensure_base_policy(cfg.policy)


def resolve_config(cfg: GRPOConfig) -> GRPOConfig:
    """Reject mode combinations the loop cannot run and fill the defaults that depend on
    other keys (``algo.use_tis``, ``sync.resume_kv_cache``); idempotent."""
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
    if cfg.engines.num_engines > 1 and not cfg.engines.router:
        raise ConfigError(
            f"engines.num_engines={cfg.engines.num_engines} needs engines.router=true: the "
            "rollout sends every request to one URL, the router's, which spreads them"
        )
    algo, sync = cfg.algo, cfg.sync
    if algo.use_tis is None:  # one-step off-policy samples need the importance correction
        algo = algo.model_copy(update={"use_tis": cfg.rollout.async_rollout})
    if sync.resume_kv_cache is None:
        sync = sync.model_copy(update={"resume_kv_cache": cfg.engines.colocate})
    return cfg.model_copy(update={"algo": algo, "sync": sync})


def _reward_fn(cfg: GRPOConfig) -> SampleRewarder:
    """Scores samples in place (``reward``, ``correct`` for ``rollout/accuracy``), off the
    event loop, each call under ``reward.timeout_s``; ``close()`` stops its workers."""
    from titan_rl.rollout.rewarding import SampleRewarder

    return SampleRewarder(cfg.reward)


class EngineMemory:
    """Colocated engines' memory (SGLang's release / resume_memory_occupation, by tags),
    called on every engine directly (a router does not forward these)."""

    def __init__(self, urls: list[str], api_key: str | None) -> None:
        from titan_rl.rollout.client import SGLangClient

        self.clients = [SGLangClient(u, api_key=api_key) for u in urls]

    async def release(self) -> None:
        """Weights, KV cache and CUDA graphs: all of it, for the trainer."""
        await asyncio.gather(*(c.release_memory_occupation(None) for c in self.clients))

    async def resume(self, tags: list[str] | None) -> None:
        await asyncio.gather(*(c.resume_memory_occupation(tags) for c in self.clients))

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


def _skipped_note(ps: PromptSet, key: str, cfg: GRPOConfig) -> None:
    if ps.skipped:
        print(
            f"data: skipped {ps.skipped} rows of {key} {ps.source} without both "
            f"{cfg.data.prompt_key!r} and {cfg.data.label_key!r}",
            flush=True,
        )


class Loop:
    """The GRPO loop over a trainer group and an engine group."""

    def __init__(self, cfg: GRPOConfig) -> None:
        from titan_core.data.tokenizer import build_tokenizer
        from titan_rl.data import PromptSampler, load_prompts

        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tok = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model)
        train = load_prompts(cfg.data, cfg.run.seed, "train")
        held_out = load_prompts(cfg.data, cfg.run.seed, "eval")
        self.eval_prompts = held_out.prompts
        #: written with the first record of the run
        self.data_stats = {"data/skipped_rows": train.skipped}
        _skipped_note(train, "data.path", cfg)
        if cfg.data.eval_path:
            self.data_stats["data/eval_skipped_rows"] = held_out.skipped
            _skipped_note(held_out, "data.eval_path", cfg)
        self.sampler = PromptSampler(train.prompts, cfg.run.seed)
        self.reward = _reward_fn(cfg)
        self.stop_ids = [self.tok.eod] + ([10] if cfg.data.type == "arithmetic" else [])
        #: gives restarted engines the current weights (set once the engines run)
        self.recovery: EngineRecovery | None = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i not in self.stop_ids])

    def versions(self) -> VersionCheck | None:
        """The weight versions a rollout accepts now (see titan_rl/actors/recovery.py)."""
        from titan_rl.rollout.generate import VersionCheck

        rec = self.recovery
        if rec is None:
            return None
        return VersionCheck(rec.accepted, self.cfg.rollout.on_stale_version, rec.ensure_serving)

    async def _watched(self, work: Any) -> Any:
        return await (work if self.recovery is None else self.recovery.guard(work))

    async def rollout(self, client: Any, step: int) -> Any:
        from titan_rl.rollout.generate import generate_groups

        r = self.cfg.rollout
        n_prompts = int(r.prompts_per_step * r.over_sample_factor)
        prompts = self.sampler.take(n_prompts)
        result = await self._watched(generate_groups(
            client, prompts, self.encode, self.decode, r, self.stop_ids, self.reward,
            want_groups=r.prompts_per_step, seed=self.cfg.run.seed * 100_003 + step,
            versions=self.versions(),
        ))  # fmt: skip
        if len(result.samples) < r.prompts_per_step * r.n_samples_per_prompt:
            raise RuntimeError(
                f"step {step}: only {len(result.samples) // r.n_samples_per_prompt} groups passed "
                "the dynamic filter; raise rollout.over_sample_factor"
            )
        return result

    async def evaluate(self, client: Any) -> float:
        from titan_rl.rollout.generate import evaluate

        return await self._watched(evaluate(
            client, self.eval_prompts, self.encode, self.decode,
            self.cfg.rollout.max_response_len, self.stop_ids, self.reward, self.versions(),
        ))  # fmt: skip


def _status(rec: dict[str, Any], total: int) -> str:
    parts = [
        f"step {rec['step']:>4}/{total}",
        f"reward {rec['reward/mean']:.3f}",
        f"rollout acc {rec['rollout/accuracy']:.3f}",
        f"len {rec['response/length_mean']:.1f}",
    ]
    if "eval/accuracy" in rec:
        parts.append(f"eval acc {rec['eval/accuracy']:.3f}")
    if rec.get("reward/timeouts") or rec.get("reward/invalid"):
        parts.append(f"reward timeouts {rec['reward/timeouts']} / invalid {rec['reward/invalid']}")
    if rec.get("engines/resyncs") or rec.get("rollout/stale_samples"):
        parts.append(
            f"engines restarted {rec['engines/restarts']} / resynced {rec['engines/resyncs']:.0f}"
            f" / stale samples {rec['rollout/stale_samples']}"
        )
    parts.append(
        f"time {rec['time/step']:.2f}s (rollout {rec['time/rollout']:.2f} / "
        f"train {rec['time/train']:.2f} / sync {rec['time/sync']:.2f})"
    )
    return " | ".join(parts)


def _step_record(step: int, result: Any, measured: dict[str, float]) -> dict[str, Any]:
    """A step's metrics from its rollout (and the trainer's and the sync's ``measured``)."""
    samples = result.samples
    n = len(samples)
    return {
        "step": step,
        "reward/mean": sum(s.reward for s in samples) / n,
        "rollout/accuracy": sum(bool(s.correct) for s in samples) / n,
        "response/length_mean": sum(s.response_length for s in samples) / n,
        "response/truncated_frac": result.truncated / n,
        "rollout/groups_generated": result.groups_generated,
        "rollout/groups_filtered": result.groups_filtered,
        "reward/timeouts": result.reward_timeouts,
        "reward/invalid": result.reward_invalid,
        "rollout/stale_samples": result.stale_samples,
        "rollout/weight_version": ",".join(sorted({s.weight_version for s in samples})),
        "data/prompt_hash": result.prompt_hash,
        **measured,
    }


def _open_metrics(path: Path, resumed_step: int) -> Any:
    """metrics.jsonl without the records past ``resumed_step`` (-1: a fresh start): a run
    killed after its last checkpoint repeats those steps, which are then recorded once."""
    from titan_core.training.metrics import MetricsWriter, drop_records_after

    dropped = drop_records_after(path, resumed_step)
    if dropped:
        print(
            f"{path}: dropped {dropped} records past step {max(resumed_step, 0)}, "
            "where this run starts",
            flush=True,
        )
    return MetricsWriter(path)


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
    from titan_core.training.metrics import MetricsWriter, read_metrics
    from titan_rl.actors.config import EngineServerConfig, RolloutEnginesConfig, RouterConfig
    from titan_rl.actors.engine_actor import RolloutEngineGroup
    from titan_rl.placement import machine_plan, ray_init_kwargs, reserve
    from titan_rl.plot import plot_rewards
    from titan_rl.rollout.client import RetryPolicy, SGLangClient
    from titan_rl.stopping import stopped_line, until_stopped
    from titan_rl.trainer.batch import pack_samples
    from titan_rl.trainer.group import TrainerGroup

    cfg = resolve_config(cfg)
    # a dataset error or an impossible layout stops the run before any pretraining
    loop = Loop(cfg)
    plan = machine_plan(cfg)
    ensure_base_checkpoint(cfg)
    if stop.requested is not None:
        print(f"stopped by {stop.name} before RL started; rerun the same command", flush=True)
        return stop.exit_code
    owns_ray = not ray.is_initialized()
    if owns_ray:
        try:
            with ignoring(signal.SIGINT):  # Ray's processes leave Ctrl-C to this job
                ray.init(**ray_init_kwargs(cfg.ray, plan))
        except SystemExit:  # SIGTERM while Ray started: its handler, not ours, got it
            ray.shutdown()
            print("stopped by SIGTERM while Ray started; rerun the same command", flush=True)
            return exit_code(signal.SIGTERM)
    stop.install()  # ray.init replaced our SIGTERM handler with its own
    placement = reserve(plan)
    trainers = TrainerGroup(cfg, placement, torch_threads=os.cpu_count())
    engines = None
    writer: MetricsWriter | None = None
    memory: EngineMemory | None = None
    aio = asyncio.new_event_loop()
    code = 0
    try:
        resumed = trainers.resume()
        start = 0
        if resumed:
            start = int(resumed["step"])
            loop.sampler.restore(resumed["sampler"])
            print(f"resumed from {loop.run_dir / 'checkpoints'} at step {start}", flush=True)
        # the last step whose policy update finished, the sampler after it, the newest save
        completed, completed_sampler = start, loop.sampler.state()
        saved: int | None = start if resumed else None
        writer = _open_metrics(loop.run_dir / "metrics.jsonl", start if resumed else -1)
        hf_dir = loop.run_dir / "hf_start"
        trainers.save_hf(str(hf_dir))
        e = cfg.engines
        engines = RolloutEngineGroup(
            RolloutEnginesConfig(
                num_engines=e.num_engines,
                server=EngineServerConfig(
                    model_path=str(hf_dir), backend=e.backend, tp_size=e.tp_size,
                    mem_fraction_static=e.mem_fraction_static,
                    enable_memory_saver=e.colocate, api_key=e.api_key,
                    skip_tokenizer_init=True, num_threads=e.num_threads,
                    weight_version=str(start), log_dir=str(loop.run_dir / "logs"),
                ),
                router=RouterConfig(enabled=e.router, log_dir=str(loop.run_dir / "logs")),
            ),
            placement.engines(),
        )  # fmt: skip
        url = engines.start()
        trainers.connect_engines(engines.urls)
        loop.recovery = engines.recovery(trainers.resync_engines, e.retry_timeout_s)
        client = SGLangClient(
            url, api_key=e.api_key, max_concurrency=cfg.rollout.max_concurrency,
            retry=RetryPolicy(timeout_s=e.retry_timeout_s),
        )  # fmt: skip
        first = dict(loop.data_stats)  # goes with the run's first record
        acc = until_stopped(aio, loop.evaluate(client), stop) if start == 0 else None
        if acc is not None:
            writer.write({"step": 0, "eval/accuracy": acc, **first})
            first = {}
            print(f"step    0 | eval acc {acc:.3f} (before RL)", flush=True)
        memory = EngineMemory(engines.urls, e.api_key) if e.colocate else None
        pending = None
        prefetched_from: dict[str, int] | None = None  # the sampler before `pending` drew
        last_end: float | None = None
        profiled = set(
            range(min(cfg.profile.steps, default=0), max(cfg.profile.steps, default=-1) + 1)
        )
        for step in range(start + 1, cfg.run.num_steps + 1):
            if stop.requested is not None:
                break
            if step in profiled:
                trainers.begin_step(step)
            t0 = time.perf_counter()
            if pending is None:
                mark = step in profiled and not cfg.rollout.async_rollout
                if mark:
                    trainers.mark("rollout", True)
                result = until_stopped(aio, loop.rollout(client, step), stop)
                if mark:
                    trainers.mark("rollout", False)
            else:
                result = pending
            if stop.requested is not None:  # before the policy update: the step is abandoned
                break
            t1 = time.perf_counter()
            if memory is not None:  # colocated: the engines' memory goes to the trainer
                aio.run_until_complete(memory.release())
            t_released = time.perf_counter()
            batch = pack_samples(result.samples, loop.tok.eod)
            if cfg.rollout.async_rollout and step < cfg.run.num_steps:
                # one-step off-policy: the next rollout runs on the current weights while this
                # step trains; importance ratios against rollout logprobs correct for it
                train_ref = [w.train.remote(batch, step) for w in trainers.workers]
                loop.recovery.on_train_queued(str(step))  # what a resync would now send
                prefetched_from = loop.sampler.state()
                pending = until_stopped(aio, loop.rollout(client, step + 1), stop)
                metrics = ray.get(train_ref)[0]
                sampler_after = prefetched_from  # a resume redraws what `pending` drew
            else:
                metrics = trainers.train(batch, step)
                pending = None
                sampler_after = loop.sampler.state()
            completed, completed_sampler = step, sampler_after
            t2 = time.perf_counter()
            aio.run_until_complete(loop.recovery.wait_all_up())  # an engine may be restarting
            if memory is not None:  # weights back; the sync resumes the KV cache once loaded
                aio.run_until_complete(
                    memory.resume(["weights"] if cfg.sync.resume_kv_cache else None)
                )
            t_resumed = time.perf_counter()
            sync = trainers.sync_weights(step)
            loop.recovery.on_sync(str(step))
            t3 = time.perf_counter()
            rec = _step_record(step, result, {**metrics, **sync})
            if step % cfg.run.eval_interval == 0 or step == cfg.run.num_steps:
                acc = until_stopped(aio, loop.evaluate(client), stop)
                if acc is not None:
                    rec["eval/accuracy"] = acc
            t4 = time.perf_counter()
            rec.update({
                "time/rollout": t1 - t0, "time/train": t2 - t_released,
                "time/sync": t3 - t_resumed, "time/eval": t4 - t3,
                # since the previous step's measures: its metrics, status line and checkpoint
                # count here (the final step's are the only ones left out)
                "time/step": t4 - (t0 if last_end is None else last_end),
            })  # fmt: skip
            if memory is not None:
                rec.update({"time/release": t_released - t1, "time/resume": t_resumed - t2})
            rec.update(aio.run_until_complete(loop.recovery.report()))
            rec["engines/restarts"] = engines.restarts()
            last_end = t4
            if step in profiled:
                trainers.end_step(step)
            writer.write({**rec, **first})
            first = {}
            if step % cfg.run.log_interval == 0 or "eval/accuracy" in rec:
                print(_status(rec, cfg.run.num_steps), flush=True)
            save_every = cfg.run.save_interval
            if (save_every and step % save_every == 0) or step == cfg.run.num_steps:
                trainers.save(step, {"sampler": sampler_after})
                saved = step
        if stop.requested is not None and completed < cfg.run.num_steps:
            if cfg.run.save_on_signal and completed > start and saved != completed:
                trainers.save(completed, {"sampler": completed_sampler})
                saved = completed
            root = loop.run_dir / "checkpoints"
            print(
                stopped_line(stop.requested, completed, start, saved, root, cfg.run.save_on_signal),
                flush=True,
            )
            code = stop.exit_code
        else:
            plot_rewards(read_metrics(loop.run_dir / "metrics.jsonl"), loop.run_dir / "reward.png")
            print(f"wrote {loop.run_dir / 'metrics.jsonl'} and {loop.run_dir / 'reward.png'}")
        aio.run_until_complete(client.aclose())
    finally:
        with contextlib.ExitStack() as cleanup:  # every step runs, even after one raised
            if owns_ray:
                cleanup.callback(ray.shutdown)  # the actors' processes, and their children
            cleanup.callback(aio.close)
            cleanup.callback(trainers.shutdown)
            cleanup.callback(loop.reward.close)
            if engines is not None:
                cleanup.callback(engines.stop)
            if writer is not None:
                cleanup.callback(writer.close)
            if loop.recovery is not None:
                cleanup.callback(lambda: aio.run_until_complete(loop.recovery.aclose()))
            if memory is not None:
                cleanup.callback(lambda: aio.run_until_complete(memory.aclose()))
    return code


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
        check_base_matches(cfg)
        check_base_dir(cfg)
        for line in learning_warnings(cfg):
            print(f"warning: {line}", file=sys.stderr)
        if args.dry_run:
            print("\n".join(placement_plan(cfg)))
            return 0
        with RunLock(cfg.run.dir):  # one job per run.dir, or exit 2 before Ray starts
            return run(cfg)
    except (ConfigError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
