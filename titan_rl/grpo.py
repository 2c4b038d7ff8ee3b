"""``python -m titan_rl.grpo --config examples/math.yaml [key.sub=value ...] [--dry-run]``

GRPO on Titan's training base: Megatron trainer actors and SGLang-API rollout engines
(the built-in engine on CPU), driven by Ray. One step:

    prompts -> n responses each (engines) -> rewards -> trainer: old/ref logprobs,
    advantages, policy update(s) -> weight sync -> eval every eval_interval -> checkpoint
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from titan_core.config import ConfigError, load_config
from titan_rl.config import GRPOConfig

EXIT_CONFIG_ERROR = 2


def placement_plan(cfg: GRPOConfig) -> list[str]:
    """What would run where, for ``--dry-run``."""
    from titan_core.accelerator import get_accelerator

    accel = get_accelerator()
    backend = cfg.engines.backend
    if backend == "auto":
        backend = "builtin" if accel.name == "cpu" else "sglang"
    p = cfg.parallel
    per_engine = cfg.engines.tp_size
    lines = [
        f"accelerator: {accel.name} (process groups: {accel.communication_backend()}, "
        f"weight sync: {cfg.sync.transport} over {accel.weight_update_backend()})",
        f"trainer: {cfg.trainer_processes} Megatron process(es) = TP{p.tensor_model_parallel_size}"
        f" x PP{p.pipeline_model_parallel_size} x EP{p.expert_model_parallel_size}, "
        f"devices 0..{cfg.trainer_processes - 1}",
        f"engines: {cfg.engines.num_engines} x {backend} (tp {per_engine}), "
        + (
            "colocated on the trainer's devices"
            if cfg.engines.colocate
            else f"devices {cfg.trainer_processes}.."
            f"{cfg.trainer_processes + cfg.engines.num_engines * per_engine - 1}"
        )
        + (", behind sglang-router" if cfg.engines.router else ""),
        f"policy: {cfg.policy.format} weights from {cfg.policy.load}",
        f"batch: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n_samples_per_prompt} "
        f"samples, {cfg.ppo_steps} update(s) per step, {cfg.run.num_steps} steps",
        f"run dir: {cfg.run.dir}",
    ]
    return lines


def ensure_base_checkpoint(cfg: GRPOConfig) -> None:
    """Pretrain the base policy with titan_core.pretrain if it is not there yet."""
    from titan_core.checkpoint import latest_iteration

    pol = cfg.policy
    if pol.format != "titan" or latest_iteration(pol.load) is not None:
        return
    if not pol.pretrain_config:
        raise ConfigError(
            f"policy.load {pol.load} holds no Titan checkpoint and policy.pretrain_config is "
            "not set; pretrain one first (python -m titan_core.pretrain) or set it"
        )
    load = Path(pol.load)
    if load.name != "checkpoints":
        raise ConfigError("policy.load must end in /checkpoints when policy.pretrain_config is set")
    print(
        f"no base checkpoint at {load}: pretraining it first with titan_core.pretrain "
        f"({pol.pretrain_config}), on the same training base",
        flush=True,
    )
    cmd = [
        sys.executable, "-m", "titan_core.pretrain", "--config", pol.pretrain_config,
        *pol.pretrain_overrides, f"run.dir={load.parent}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True)


def _reward_fn(cfg: GRPOConfig):  # noqa: ANN202
    from titan_rl.rewards import RewardScorer

    return RewardScorer(cfg.reward).score


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
        self.eval_prompts = load_prompts(cfg.data, cfg.run.seed, "eval").prompts
        if train.skipped:
            print(f"data: skipped {train.skipped} rows without prompt/label keys", flush=True)
        self.sampler = PromptSampler(train.prompts, cfg.run.seed)
        self.reward = _reward_fn(cfg)
        self.stop_ids = [self.tok.eod] + ([10] if cfg.data.type == "arithmetic" else [])

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i not in self.stop_ids])

    async def rollout(self, client: Any, step: int) -> Any:
        from titan_rl.rollout.generate import generate_groups

        r = self.cfg.rollout
        n_prompts = int(r.prompts_per_step * r.over_sample_factor)
        prompts = self.sampler.take(n_prompts)
        result = await generate_groups(
            client, prompts, self.encode, self.decode, r, self.stop_ids, self.reward,
            want_groups=r.prompts_per_step, seed=self.cfg.run.seed * 100_003 + step,
        )  # fmt: skip
        if len(result.samples) < r.prompts_per_step * r.n_samples_per_prompt:
            raise RuntimeError(
                f"step {step}: only {len(result.samples) // r.n_samples_per_prompt} groups passed "
                "the dynamic filter; raise rollout.over_sample_factor"
            )
        return result

    async def evaluate(self, client: Any) -> float:
        from titan_rl.rollout.generate import evaluate

        return await evaluate(
            client, self.eval_prompts, self.encode, self.decode,
            self.cfg.rollout.max_response_len, self.stop_ids, self.reward,
        )  # fmt: skip


def _status(rec: dict[str, Any], total: int) -> str:
    parts = [
        f"step {rec['step']:>4}/{total}",
        f"reward {rec['reward/mean']:.3f}",
        f"len {rec['response/length_mean']:.1f}",
    ]
    if "eval/accuracy" in rec:
        parts.append(f"eval acc {rec['eval/accuracy']:.3f}")
    parts.append(
        f"time {rec['time/step']:.2f}s (rollout {rec['time/rollout']:.2f} / "
        f"train {rec['time/train']:.2f} / sync {rec['time/sync']:.2f})"
    )
    return " | ".join(parts)


def run(cfg: GRPOConfig) -> int:
    import ray

    from titan_core.training.metrics import MetricsWriter, read_metrics
    from titan_rl.actors.config import EngineServerConfig, RolloutEnginesConfig, RouterConfig
    from titan_rl.actors.engine_actor import RolloutEngineGroup
    from titan_rl.plot import plot_rewards
    from titan_rl.rollout.client import SGLangClient
    from titan_rl.trainer.batch import pack_samples
    from titan_rl.trainer.group import TrainerGroup

    ensure_base_checkpoint(cfg)
    loop = Loop(cfg)
    if not ray.is_initialized():
        ray.init(
            address=cfg.ray.address,
            num_cpus=cfg.ray.num_cpus or max(2, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    trainers = TrainerGroup(cfg, torch_threads=os.cpu_count())
    engines = None
    writer = MetricsWriter(loop.run_dir / "metrics.jsonl")
    aio = asyncio.new_event_loop()
    try:
        resumed = trainers.resume()
        start = 0
        if resumed:
            start = int(resumed["step"])
            loop.sampler.restore(resumed["sampler"])
            print(f"resumed from {loop.run_dir / 'checkpoints'} at step {start}", flush=True)
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
            )
        )  # fmt: skip
        url = engines.start()
        trainers.connect_engines(engines.urls)
        client = SGLangClient(url, api_key=e.api_key, max_concurrency=cfg.rollout.max_concurrency)
        if start == 0:
            acc = aio.run_until_complete(loop.evaluate(client))
            writer.write({"step": 0, "eval/accuracy": acc})
            print(f"step    0 | eval acc {acc:.3f} (before RL)", flush=True)
        pending = None
        profiled = set(
            range(min(cfg.profile.steps, default=0), max(cfg.profile.steps, default=-1) + 1)
        )
        for step in range(start + 1, cfg.run.num_steps + 1):
            if step in profiled:
                trainers.begin_step(step)
            t0 = time.perf_counter()
            if pending is None:
                mark = step in profiled and not cfg.rollout.async_rollout
                if mark:
                    trainers.mark("rollout", True)
                result = aio.run_until_complete(loop.rollout(client, step))
                if mark:
                    trainers.mark("rollout", False)
            else:
                result = pending
            t1 = time.perf_counter()
            batch = pack_samples(result.samples, loop.tok.eod)
            if cfg.rollout.async_rollout and step < cfg.run.num_steps:
                # one-step off-policy: the next rollout runs on the current weights while this
                # step trains; importance ratios against rollout logprobs correct for it
                train_ref = [w.train.remote(batch) for w in trainers.workers]
                pending = aio.run_until_complete(loop.rollout(client, step + 1))
                metrics = ray.get(train_ref)[0]
            else:
                metrics = trainers.train(batch)
                pending = None
            t2 = time.perf_counter()
            sync = trainers.sync_weights(step)
            t3 = time.perf_counter()
            samples = result.samples
            rec: dict[str, Any] = {
                "step": step,
                "reward/mean": sum(s.reward for s in samples) / len(samples),
                "response/length_mean": sum(s.response_length for s in samples) / len(samples),
                "response/truncated_frac": result.truncated / len(samples),
                "rollout/groups_generated": result.groups_generated,
                "rollout/groups_filtered": result.groups_filtered,
                **metrics,
                **sync,
            }
            if step % cfg.run.eval_interval == 0 or step == cfg.run.num_steps:
                rec["eval/accuracy"] = aio.run_until_complete(loop.evaluate(client))
            t4 = time.perf_counter()
            rec.update({
                "time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2,
                "time/eval": t4 - t3, "time/step": t4 - t0,
            })  # fmt: skip
            if step in profiled:
                trainers.end_step(step)
            writer.write(rec)
            if step % cfg.run.log_interval == 0 or "eval/accuracy" in rec:
                print(_status(rec, cfg.run.num_steps), flush=True)
            save_every = cfg.run.save_interval
            if (save_every and step % save_every == 0) or step == cfg.run.num_steps:
                trainers.save(step, {"sampler": loop.sampler.state()})
        plot_rewards(read_metrics(loop.run_dir / "metrics.jsonl"), loop.run_dir / "reward.png")
        print(f"wrote {loop.run_dir / 'metrics.jsonl'} and {loop.run_dir / 'reward.png'}")
        aio.run_until_complete(client.aclose())
    finally:
        writer.close()
        if engines is not None:
            engines.stop()
        trainers.shutdown()
        aio.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m titan_rl.grpo", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--config", help="YAML config (see examples/math.yaml)")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the placement plan")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(GRPOConfig, args.config, args.overrides)
        if args.dry_run:
            print("\n".join(placement_plan(cfg)))
            return 0
        return run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
