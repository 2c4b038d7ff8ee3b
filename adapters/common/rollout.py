"""The rollout side slime's and miles' drivers share: sampling parameters from their flags,
generating and scoring sample groups through the framework's hooks, the metrics, and the
engine half of a rollout manager over Titan's engines.

Both frameworks' own rollout managers import ``sglang`` at the top (no CPU build) and start
SGLang servers themselves; ``adapters.slime.rollout`` and ``adapters.miles.rollout`` put
:class:`TitanEngines` under their framework's manager surface.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from adapters.common import engine_recovery

#: generate requests in flight at once (slime's / miles' --sglang-server-concurrency default)
CONCURRENCY = 512


def sampling_params(args: Any, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling parameters from the rollout (or eval) flags, as slime and miles build
    them (``--eval-*`` override the rollout's for an evaluation)."""
    temperature, max_new = args.rollout_temperature, args.rollout_max_response_len
    if evaluation:
        if args.eval_temperature is not None:
            temperature = args.eval_temperature
        if args.eval_max_response_len is not None:
            max_new = args.eval_max_response_len
    if max_new is None:
        raise ValueError("set --rollout-max-response-len (the response budget per sample)")
    top_p, top_k = args.rollout_top_p, args.rollout_top_k
    if evaluation:
        top_p = args.eval_top_p if getattr(args, "eval_top_p", None) is not None else top_p
        top_k = args.eval_top_k if getattr(args, "eval_top_k", None) is not None else top_k
    params: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_new_tokens": max_new,
        "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", False),
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if args.rollout_stop:
        params["stop"] = list(args.rollout_stop)
    if args.rollout_stop_token_ids:
        params["stop_token_ids"] = list(args.rollout_stop_token_ids)
    if evaluation and getattr(args, "eval_min_new_tokens", None):
        params["min_new_tokens"] = args.eval_min_new_tokens
    return params


def _capped(args: Any, sample: Any, params: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """``params`` with ``max_new_tokens`` cut so prompt + response fit in ``limit`` tokens
    (slime's ``--rollout-max-context-len`` / ``--eval-max-context-len``)."""
    params = dict(params)
    if limit is None:
        return params
    from adapters.common.clients import run_tokenizer

    prompt = len(sample.tokens) if sample.tokens else len(
        run_tokenizer(args, "count the prompt's tokens").encode(sample.prompt)
    )  # fmt: skip
    params["max_new_tokens"] = max(0, min(int(params["max_new_tokens"]), limit - prompt))
    return params


async def generate_and_score(
    args: Any,
    groups: list[list[Any]],
    params: dict[str, Any],
    generate: Callable,
    rm: Callable,
    context_limit: int | None = None,
    evaluation: bool = False,
    pool: Any = None,
) -> None:
    """Every sample through ``generate(args, sample, params)`` (at most :data:`CONCURRENCY`
    at once), then scored by ``rm``: per sample, or per group with ``--group-rm``, as slime's
    and miles' reward hub call a ``--custom-rm-path`` function; each reward checked
    (:func:`check_rewards`). Groups are updated in place. With ``pool`` (the run's
    ``titan_rl.rewards.pool.RewardPool``, :func:`reward_pool`) each call runs in a worker
    process under ``reward.timeout_s``, as the main job's rewards do."""
    from adapters.common.clients import aclose_clients

    sem = asyncio.Semaphore(getattr(args, "sglang_server_concurrency", None) or CONCURRENCY)
    recovery = engine_recovery.active()

    async def one(sample: Any) -> Any:
        async with sem:
            capped = _capped(args, sample, params, context_limit)
            if recovery is None:
                return await generate(args, sample, capped)
            while True:  # a response on other weights (a restarted engine): sent again
                before = copy.deepcopy(sample)
                sample = await generate(args, sample, capped)
                if engine_recovery.is_current(sample, recovery):
                    return sample
                engine_recovery.note_resent()
                sample = before
                await recovery.ensure_serving()

    try:
        work = asyncio.gather(*(asyncio.gather(*(one(s) for s in g)) for g in groups))
        done = await (work if recovery is None else recovery.guard(work))
        for g, got in zip(groups, done, strict=True):
            g[:] = list(got)
        scored = _Scoring(args, rm, pool)
        if args.group_rm:
            scores = await asyncio.gather(*(scored.call(g, g) for g in groups))
            for g, rewards in zip(groups, scores, strict=True):
                if rewards is TIMED_OUT:  # the group's call ran past reward.timeout_s
                    rewards = [scored.timeout_score] * len(g)
                for s, r in zip(g, rewards, strict=True):
                    s.reward = r
        else:
            flat = [s for g in groups for s in g]
            rewards = await asyncio.gather(*(scored.call(s, [s]) for s in flat))
            for s, r in zip(flat, rewards, strict=True):
                s.reward = scored.timeout_score if r is TIMED_OUT else r
        check_rewards(args, [s for g in groups for s in g], evaluation)
        scored.report(sum(map(len, groups)), "an evaluation" if evaluation else "a rollout")
    finally:
        await aclose_clients()
        if recovery is not None:  # its connections belong to this event loop
            await recovery.aclose()


#: what a reward call that ran past ``reward.timeout_s`` gives (None is a hook's own answer)
TIMED_OUT = object()


class _Scoring:
    """One rollout's reward calls: through the pool (a timed-out call is :data:`TIMED_OUT`,
    counted) or, without one, awaited here."""

    def __init__(self, args: Any, rm: Callable, pool: Any) -> None:
        self.args, self.rm, self.pool = args, rm, pool
        self.timeouts = 0
        self.cfg = pool.cfg if pool is not None else None
        self.timeout_score = self.cfg.timeout_score if self.cfg is not None else 0.0
        self.path = f"{rm.__module__}.{rm.__qualname__}"
        if pool is not None and "<" in self.path:
            raise ValueError(
                f"{self.path} cannot run in a reward worker: not a module-level function"
            )

    async def call(self, arg: Any, samples: list[Any]) -> Any:
        if self.pool is None:
            return await self.rm(self.args, arg)
        ok, value = await self.pool.call_hook(
            self.path, self.args, arg, where=reward_source(self.args), sample=_describe(samples[0])
        )  # fmt: skip
        if not ok:
            self.timeouts += len(samples)
        return value if ok else TIMED_OUT

    def report(self, scored: int, what: str) -> None:
        """``reward/timeouts``; a warning line, or under ``reward.on_timeouts=stop`` a
        RewardTimeoutsError, when most calls timed out (the main job's rule)."""
        global _reward_timeouts
        if self.cfg is None:
            return
        from titan_rl.rewards.pool import timeouts_note

        _reward_timeouts += self.timeouts
        note = timeouts_note(self.cfg, self.timeouts, scored, what, reward_source(self.args))
        if note is not None:
            print(f"warning: {note}", flush=True)


#: reward calls that timed out since the last :func:`take_reward_timeouts`
_reward_timeouts = 0
_pool: Any = None


def reward_pool(args: Any, rm: Callable) -> Any:
    """This process's reward workers (``titan_rl.rewards.pool.RewardPool`` of the run's
    ``reward`` section: ``reward.timeout_s``, ``reward.timeout_score``, ``reward.num_workers``,
    ``reward.on_timeouts``), made on first use; they start with ``rm``'s module (the
    framework's rm hub) imported."""
    global _pool
    if _pool is None:
        from adapters.common.config import titan_config_from_args
        from titan_rl.rewards.pool import RewardPool

        _pool = RewardPool(titan_config_from_args(args).reward, preload=[rm.__module__])
    return _pool


def close_reward_pool() -> None:
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.close()


def take_reward_timeouts() -> int:
    global _reward_timeouts
    n, _reward_timeouts = _reward_timeouts, 0
    return n


def reward_source(args: Any) -> str:
    """The reward as the user named it on the command line (slime's / miles' rm hub calls
    ``--custom-rm-path`` where given, else scores by ``--rm-type``)."""
    if getattr(args, "custom_rm_path", None):
        return f"--custom-rm-path {args.custom_rm_path}"
    return f"--rm-type {getattr(args, 'rm_type', None)}"


def check_rewards(args: Any, samples: list[Any], evaluation: bool) -> None:
    """Every sample's reward (``--reward-key`` / ``--eval-reward-key`` of a dict) is a bool
    or a number finite in float32, the trainer's dtype (``1e39`` is inf there); anything
    else is an InvalidRewardError naming the flag that chose the reward, the value and the
    sample, raised before the samples are trained or counted."""
    from titan_rl.rewards.errors import InvalidRewardError
    from titan_rl.rewards.scorer import checked_score

    key = getattr(args, "eval_reward_key", None) if evaluation else None
    key = key or getattr(args, "reward_key", None)
    for s in samples:
        value = s.reward
        if key is not None:
            if not isinstance(value, dict) or key not in value:
                raise InvalidRewardError(
                    f"{reward_source(args)} returned {value!r} for {_describe(s)}: the reward "
                    f"key {key!r} (--reward-key / --eval-reward-key) is not in it"
                )
            value = value[key]
        advice = "fix the reward function (slime and miles train on every sample)"
        checked_score(value, reward_source(args), _describe(s), key, advice=advice)


def _texts(sample: Any) -> tuple[str, str, Any]:
    prompt = sample.prompt if isinstance(sample.prompt, str) else repr(sample.prompt)
    return prompt, sample.response or "", sample.label


def _describe(sample: Any) -> str:
    from titan_rl.rewards.scorer import describe_sample

    return describe_sample(*_texts(sample))


def summary(args: Any, samples: list[Any], evaluation: bool, truncated: Any) -> dict[str, float]:
    """titan_rl's metric names (a reward of 1 or more counts as a right answer);
    ``truncated`` is the framework's ``Sample.Status.TRUNCATED``."""
    n = max(1, len(samples))
    key = getattr(args, "eval_reward_key", None) if evaluation else None
    rewards = [float(s.reward[key] if key else s.get_reward_value(args)) for s in samples]
    accuracy = sum(r >= 1.0 for r in rewards) / n
    if evaluation:
        return {"eval/accuracy": accuracy, "eval/reward": sum(rewards) / n}
    return {
        "reward/mean": sum(rewards) / n,
        "rollout/accuracy": accuracy,
        "response/length_mean": sum(s.response_length for s in samples) / n,
        "response/truncated_frac": sum(s.status == truncated for s in samples) / n,
    }


def eval_data(
    args: Any, groups: list[list[Any]], names: list[str] | None, metrics: dict[str, float]
) -> dict[str, Any]:
    """An evaluation's data as slime's and miles' eval rollouts hand it on: per named set
    (``--eval-prompt-data NAME PATH``) its rewards and samples, each set's mean reward put in
    ``metrics`` as ``eval/NAME``; without names, one set ``eval``."""
    flat = [s for g in groups for s in g]
    if names is None:
        return {"eval": {"rewards": [s.reward for s in flat], "samples": flat}}
    key = getattr(args, "eval_reward_key", None)
    data: dict[str, Any] = {}
    for group, name in zip(groups, names, strict=True):
        entry = data.setdefault(name, {"rewards": [], "samples": []})
        entry["rewards"] += [s.reward[key] if key else s.get_reward_value(args) for s in group]
        entry["samples"] += group
    for name, entry in data.items():
        metrics[f"eval/{name}"] = sum(map(float, entry["rewards"])) / len(entry["rewards"])
    return data


def rollout_groups(
    args: Any,
    data_source: Any,
    evaluation: bool,
    generate: Callable,
    rm: Callable,
    eval_groups: list[list[Any]] | None = None,
) -> list[list[Any]]:
    """One rollout's sample groups (``--rollout-batch-size`` prompts from the source) or, for
    an evaluation, ``eval_groups`` (default: the source's ``eval_samples()``, one response
    each); generated and scored by ``rm`` (the framework's rm_hub, which calls
    ``--custom-rm-path`` where given, else scores by ``--rm-type``)."""
    if evaluation:
        if eval_groups is None:
            if not hasattr(data_source, "eval_samples"):
                raise ValueError(
                    f"{type(data_source).__name__} has no eval_samples(); name the eval sets "
                    "with --eval-prompt-data NAME PATH or set your own --eval-function-path"
                )
            eval_groups = [[s] for s in data_source.eval_samples()]
        groups = eval_groups
    else:
        groups = data_source.get_samples(args.rollout_batch_size)
    limit = getattr(args, "rollout_max_context_len", None)
    if evaluation and getattr(args, "eval_max_context_len", None) is not None:
        limit = args.eval_max_context_len
    params = sampling_params(args, evaluation)
    asyncio.run(
        generate_and_score(
            args, groups, params, generate, rm, limit, evaluation, reward_pool(args, rm)
        )
    )
    return groups


async def _report(recovery: Any) -> dict[str, float]:
    """The recovery's report on an event loop of its own (a module function: an ``async``
    method would make the manager an asyncio Ray actor, whose hooks call asyncio.run)."""
    try:
        return await recovery.report()
    finally:
        await recovery.aclose()


class TitanEngines:
    """The engine half of a slime / miles rollout manager: Titan's engines (the built-in CPU
    engine, or SGLang servers) on the framework's rollout bundles, behind handles with the
    framework's engine-actor methods; colocated memory release / resume; the trainer layout
    the framework's DP split needs; the last rollout's metrics; the data source's state."""

    def __init__(self, args: Any, pg: Any = None) -> None:
        from adapters.common.config import titan_config_from_args

        self.args = args
        self.pg = pg
        self.cfg = titan_config_from_args(args)
        self.engine_group: Any = None
        self.engines: list[Any] = []
        self.data_source: Any = None
        self.train_parallel_config: dict[str, int] | None = None
        self.metrics: dict[str, float] = {}
        self.recovery: Any = None
        self.trainers: list[Any] = []
        self.weight_version: int | str | None = None

    # ---- engines ------------------------------------------------------------------------------
    def engines_config(self) -> Any:
        """The run's Titan config with the framework's engine layout written into it:
        ``--rollout-num-gpus / --rollout-num-gpus-per-engine`` engines of
        ``--rollout-num-gpus-per-engine`` devices, sharing the trainer's with ``--colocate``,
        beside ``--actor-num-nodes x --actor-num-gpus-per-node`` trainer ranks; the framework's
        loop decides when rollouts run (never beside training while colocated)."""
        args, cfg = self.args, self.cfg
        per_engine = args.rollout_num_gpus_per_engine
        engines = cfg.engines.model_copy(update={
            "num_engines": max(1, args.rollout_num_gpus // per_engine), "tp_size": per_engine,
            "colocate": bool(args.colocate),
        })  # fmt: skip
        trainer = cfg.trainer.model_copy(
            update={"num_processes": args.actor_num_nodes * args.actor_num_gpus_per_node}
        )
        rollout = cfg.rollout.model_copy(update={"async_rollout": False})
        return cfg.model_copy(update={"engines": engines, "trainer": trainer, "rollout": rollout})

    def engine_launch(self, model_path: str) -> Any:
        """What each engine runs: the GRPO job's launch (titan_rl.placement.engine_launch, from
        the same ``engines`` and ``rollout`` sections and the same thread rule) on the
        framework's layout, serving ``model_path`` with its tokenizer, as slime's and miles'
        SGLang servers load ``--hf-checkpoint`` (``--rollout-stop`` texts need it); SGLang
        servers get the ``--sglang-*`` flags."""
        from adapters.common.driver import generated_args
        from titan_core.accelerator import get_accelerator
        from titan_rl.placement import engine_launch, job_threads

        cfg = self.engines_config()
        return engine_launch(
            cfg, get_accelerator().name, job_threads(cfg), model_path,
            sglang_args=generated_args(self.args, "--sglang-"),
        )  # fmt: skip

    def start_titan_engines(self, model_path: str) -> tuple[list[str], str]:
        """The engines (:meth:`engine_launch`) on the framework's rollout bundles, behind a
        router where there are several; returns (their URLs, the URL generation goes to: the
        router, or the only engine)."""
        from adapters.common.driver import generated_args
        from titan_rl.actors.config import PlacedEngine, RouterConfig
        from titan_rl.actors.engine_actor import RolloutEngineGroup

        args, e = self.args, self.cfg.engines
        launch = self.engine_launch(model_path)
        per_engine = args.rollout_num_gpus_per_engine
        n = max(1, args.rollout_num_gpus // per_engine)
        places = self._placements(n, per_engine)
        group = RolloutEngineGroup(
            [PlacedEngine(launch)] * n if places is None else [p.place(launch) for p in places],
            RouterConfig(enabled=n > 1, extra_args=generated_args(args, "--router-")),
        )
        self.engine_group = group
        url = group.start()
        # the main job's recovery: a restarted engine gets the trainers' weights before it
        # serves (adapters.common.engine_recovery)
        self.recovery = group.recovery(self._resync, e.retry_timeout_s, e.client)
        engine_recovery.install(self.recovery)
        return list(group.urls), url

    def set_trainers(self, trainers: list[Any]) -> None:
        """The trainer ranks' actors (each has ``resync_engines``), for engine recovery."""
        self.trainers = list(trainers)

    def _resync(self, urls: list[str], version: str) -> dict[str, float]:
        import ray

        if not self.trainers:
            raise RuntimeError("no trainer ranks to resync the restarted engines from")
        return ray.get([t.resync_engines.remote(urls, version) for t in self.trainers])[0] or {}

    def set_weight_version(self, weight_version: int | str) -> None:
        """The version the trainers just synced: what the rollout accepts from now on."""
        self.weight_version = weight_version
        if self.recovery is not None:
            self.recovery.on_sync(str(weight_version))

    def engine_metrics(self) -> dict[str, float]:
        """What the rollouts met since the last call: engine restarts by their supervisors
        (total), resyncs, engines serving, samples sent again for a stale weight version,
        reward calls that timed out."""
        out = {
            "rollout/stale_resent": float(engine_recovery.take_resent()),
            "reward/timeouts": float(take_reward_timeouts()),
        }
        if self.engine_group is None or self.recovery is None:
            return out
        out["engines/restarts"] = float(self.engine_group.restarts())
        out.update(asyncio.run(_report(self.recovery)))
        return out

    def serve(self, urls: list[str], url: str) -> None:
        """Point the framework's router address args at ``url`` (what its generate posts
        to) and make one engine handle per URL."""
        from adapters.common.engines import engine_handles

        host, _, port = url.split("://", 1)[-1].rpartition(":")
        self.args.sglang_router_ip, self.args.sglang_router_port = host, int(port)
        self.engines = engine_handles(urls, self.cfg.engines.api_key)

    def _placements(self, n: int, per_engine: int) -> list[Any] | None:
        """Engine i on the rollout bundles [i*per_engine, ...) of the framework's placement
        group, SGLang's base GPU id from its bundle -> GPU map (None: engines float)."""
        if self.pg is None or self.pg[0] is None:
            return None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from titan_rl.placement import EnginePlacement

        pg, bundles, gpu_ids = self.pg
        share = 0.2 if self.args.colocate else 1.0
        out = []
        for i in range(n):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundles[i * per_engine]
            )
            gpu = int(gpu_ids[i * per_engine]) if gpu_ids else None
            opts: dict[str, Any] = {"scheduling_strategy": strategy, "num_cpus": 0}
            if gpu is not None and self.cfg.engines.backend != "builtin":
                opts["num_gpus"] = share
            out.append(EnginePlacement(actor_options=opts, base_gpu_id=gpu, bind_node_ip=False))
        return out

    def engine_gpus(self) -> tuple[list[int], list[int]]:
        """(devices per engine, each engine's first device in the rollout span)."""
        per = self.args.rollout_num_gpus_per_engine
        return [per] * len(self.engines), [i * per for i in range(len(self.engines))]

    # ---- what the loop and the trainers ask -------------------------------------------------
    def set_train_parallel_config(self, config: dict[str, int]) -> None:
        self.train_parallel_config = config

    def get_train_parallel_config(self) -> dict[str, int] | None:
        return self.train_parallel_config

    def get_metrics(self) -> dict[str, float]:
        """The last rollout's metrics (reward, accuracy, response length, truncated)."""
        return self.metrics

    def get_num_rollout_per_epoch(self) -> int:
        return len(self.data_source) // self.args.rollout_batch_size

    def load(self, rollout_id: int | None = None) -> None:
        self.data_source.load(rollout_id)

    # ---- colocated memory -------------------------------------------------------------------
    def offload(self, tags: list[str] | None = None) -> None:
        import ray

        ray.get([e.release_memory_occupation.remote() for e in self.engines])

    def onload(self, tags: list[str] | None = None) -> None:
        import ray

        ray.get([e.resume_memory_occupation.remote(tags) for e in self.engines])

    def onload_weights(self) -> None:
        self.onload(["weights"])

    def onload_kv(self) -> None:
        self.onload(["kv_cache", "cuda_graph"])

    def dispose(self) -> None:
        close_reward_pool()
        if (close := getattr(self.data_source, "close", None)) is not None:
            close()
        if self.engine_group is not None:
            engine_recovery.install(None)
            self.engine_group.stop()
            self.engine_group = None
