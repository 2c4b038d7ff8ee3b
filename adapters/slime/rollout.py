"""The rollout side of ``python -m adapters.slime.train``: a rollout function with slime's
``--rollout-function-path`` signature and the rollout manager the loop talks to.

slime's ``RolloutManager`` (``slime.ray.rollout``) imports ``sglang`` at the top and starts
SGLang servers itself, neither of which runs on a CPU machine; its default rollout function
(``slime.rollout.sglang_rollout``) imports ``sglang`` too. :class:`TitanRolloutManager`
replaces the manager with the same methods the loop and the train actors call
(``generate``, ``eval``, ``save``, ``load``, ``get_updatable_engines_and_lock``,
``set_train_parallel_config``, ``offload`` / ``onload``); its engines are Titan's (the
built-in CPU engine, or SGLang servers on GPUs) and it loads every hook exactly as slime
does, with ``slime.utils.misc.load_function``: ``--data-source-path``,
``--rollout-function-path``, ``--eval-function-path``, ``--custom-generate-function-path``,
``--custom-rm-path``. Samples become train data as slime's manager makes it
(``adapters.slime.train_data``, slime's own DP schedule).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from adapters.peers import import_peer
from adapters.slime.train_data import samples_to_train_data, split_by_dp

_misc = import_peer("slime.utils.misc")
_base_types = import_peer("slime.rollout.base_types")

#: generate requests in flight at once (slime's --sglang-server-concurrency default)
CONCURRENCY = 512


def sampling_params(args: Any, evaluation: bool) -> dict[str, Any]:
    """SGLang sampling parameters from slime's rollout (or eval) flags, as slime builds them."""
    temperature = args.rollout_temperature
    max_new = args.rollout_max_response_len
    if evaluation:
        if args.eval_temperature is not None:
            temperature = args.eval_temperature
        if args.eval_max_response_len is not None:
            max_new = args.eval_max_response_len
    if max_new is None:
        raise ValueError("set --rollout-max-response-len (the response budget per sample)")
    params: dict[str, Any] = {
        "temperature": temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": max_new,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if args.rollout_stop:
        params["stop"] = list(args.rollout_stop)
    if args.rollout_stop_token_ids:
        params["stop_token_ids"] = list(args.rollout_stop_token_ids)
    return params


def _hooks(args: Any) -> tuple[Any, Any]:
    if not args.custom_rm_path:
        raise ValueError(
            "set --custom-rm-path (e.g. adapters.slime.rewards.exact_match or "
            "adapters.slime.rewards.math_verify): slime's rm_hub is not loaded by this driver"
        )
    gen_path = args.custom_generate_function_path or "adapters.slime.generate.generate"
    return _misc.load_function(gen_path), _misc.load_function(args.custom_rm_path)


async def _generate_and_score(args: Any, groups: list[list[Any]], params: dict[str, Any]) -> None:
    from adapters.slime.generate import aclose_clients

    generate, rm = _hooks(args)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(sample: Any) -> Any:
        async with sem:
            return await generate(args, sample, dict(params))

    try:
        for g, done in zip(
            groups,
            await asyncio.gather(*(asyncio.gather(*(one(s) for s in grp)) for grp in groups)),
            strict=True,
        ):
            g[:] = list(done)
        if args.group_rm:
            scores = await asyncio.gather(*(rm(args, grp) for grp in groups))
            for grp, rewards in zip(groups, scores, strict=True):
                for s, r in zip(grp, rewards, strict=True):
                    s.reward = r
        else:
            flat = [s for grp in groups for s in grp]
            for s, r in zip(flat, await asyncio.gather(*(rm(args, s) for s in flat)), strict=True):
                s.reward = r
    finally:
        await aclose_clients()


def _summary(args: Any, samples: list[Any], evaluation: bool) -> dict[str, float]:
    """titan_rl's metric names: a reward of 1 or more counts as a right answer."""
    status = import_peer("slime.utils.types").Sample.Status
    n = max(1, len(samples))
    rewards = [float(s.get_reward_value(args)) for s in samples]
    accuracy = sum(r >= 1.0 for r in rewards) / n
    if evaluation:
        return {"eval/accuracy": accuracy, "eval/reward": sum(rewards) / n}
    return {
        "reward/mean": sum(rewards) / n,
        "rollout/accuracy": accuracy,
        "response/length_mean": sum(s.response_length for s in samples) / n,
        "response/truncated_frac": sum(s.status == status.TRUNCATED for s in samples) / n,
    }


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False):
    """slime's rollout function: one rollout's sample groups (or the evaluation set) through
    ``--custom-generate-function-path`` (default ``adapters.slime.generate.generate``), scored
    by ``--custom-rm-path``. Evaluation uses the source's ``eval_samples()`` (one response
    each, ``--eval-temperature`` / ``--eval-max-response-len``)."""
    params = sampling_params(args, evaluation)
    if evaluation:
        if not hasattr(data_source, "eval_samples"):
            raise ValueError(
                f"{type(data_source).__name__} has no eval_samples(); evaluate with "
                "adapters.slime.data_source.TitanPromptSource or your own --eval-function-path"
            )
        groups = [[s] for s in data_source.eval_samples()]
    else:
        groups = data_source.get_samples(args.rollout_batch_size)
    asyncio.run(_generate_and_score(args, groups, params))
    flat = [s for grp in groups for s in grp]
    if evaluation:
        data = {"eval": {"rewards": [s.reward for s in flat], "samples": flat}}
        return _base_types.RolloutFnEvalOutput(data=data, metrics=_summary(args, flat, True))
    return _base_types.RolloutFnTrainOutput(samples=groups, metrics=_summary(args, flat, False))


class TitanRolloutManager:
    """slime's rollout manager surface over Titan's engines (a Ray actor in the driver)."""

    def __init__(self, args: Any, pg: Any = None) -> None:
        from adapters.common.config import titan_config_from_args

        self.args = args
        self.pg = pg
        self.cfg = titan_config_from_args(args)
        self.data_source = _misc.load_function(args.data_source_path)(args)
        self.generate_rollout = _misc.load_function(args.rollout_function_path)
        self.eval_generate_rollout = _misc.load_function(args.eval_function_path)
        self.train_parallel_config: dict[str, int] | None = None
        self.engine_group: Any = None
        self.engines: list[Any] = []
        self.lock: Any = None
        self.metrics: dict[str, float] = {}

    # ---- engines ------------------------------------------------------------------------------
    def start_engines(self, model_path: str) -> list[str]:
        """Start ``--rollout-num-gpus / --rollout-num-gpus-per-engine`` engines serving
        ``model_path``; slime's router address args point at them. Returns their URLs."""
        from adapters.common.engines import engine_handles
        from titan_rl.actors.config import EngineServerConfig, RolloutEnginesConfig, RouterConfig
        from titan_rl.actors.engine_actor import RolloutEngineGroup

        args, e = self.args, self.cfg.engines
        per_engine = args.rollout_num_gpus_per_engine
        n = max(1, args.rollout_num_gpus // per_engine)
        group = RolloutEngineGroup(
            RolloutEnginesConfig(
                num_engines=n,
                server=EngineServerConfig(
                    model_path=model_path, backend=e.backend, tp_size=per_engine,
                    mem_fraction_static=e.mem_fraction_static, enable_memory_saver=args.colocate,
                    api_key=e.api_key, skip_tokenizer_init=True, num_threads=e.num_threads,
                ),
                router=RouterConfig(enabled=n > 1),
            ),
            self._placements(n, per_engine),
        )  # fmt: skip
        self.engine_group = group
        url = group.start()
        host, _, port = url.removeprefix("http://").rpartition(":")
        args.sglang_router_ip, args.sglang_router_port = host, int(port)
        self.engines = engine_handles(group.urls, e.api_key)
        self.lock = import_peer("slime.ray.utils").Lock.options(num_cpus=0).remote()
        return list(group.urls)

    def _placements(self, n: int, per_engine: int) -> list[Any] | None:
        """Engine i on the rollout bundles [i*per_engine, ...) of slime's placement group,
        with SGLang's base GPU id from slime's bundle -> GPU map (None: engines float)."""
        if self.pg is None or self.pg[0] is None:
            return None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from titan_rl.placement import EnginePlacement

        pg, bundles, gpu_ids = self.pg
        share = 0.2 if self.args.colocate else 1.0
        out = []
        for i in range(n):
            b = bundles[i * per_engine]
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=b
            )
            gpu = int(gpu_ids[i * per_engine]) if gpu_ids else None
            opts = {"scheduling_strategy": strategy, "num_cpus": 0}
            if gpu is not None and self.cfg.engines.backend != "builtin":
                opts["num_gpus"] = share
            out.append(EnginePlacement(actor_options=opts, base_gpu_id=gpu, bind_node_ip=False))
        return out

    def get_updatable_engines_and_lock(self) -> tuple:
        """slime's tuple: engines, lock, new engines, GPUs per engine, GPU offsets, configs."""
        per = self.args.rollout_num_gpus_per_engine
        n = len(self.engines)
        offsets = [i * per for i in range(n)]
        return self.engines, self.lock, 0, [per] * n, offsets, [{"tp_size": per}] * n

    def set_train_parallel_config(self, config: dict[str, int]) -> None:
        self.train_parallel_config = config

    def get_train_parallel_config(self) -> dict[str, int] | None:
        return self.train_parallel_config

    # ---- rollouts -------------------------------------------------------------------------------
    def generate(self, rollout_id: int) -> list[Any]:
        """One rollout: samples -> slime's train data -> one Box per DP rank."""
        if self.train_parallel_config is None:
            raise RuntimeError("generate() before the train actors reported their layout")
        out = _base_types.call_rollout_fn(
            self.generate_rollout, self.args, rollout_id, self.data_source, evaluation=False
        )
        samples = out.samples
        while samples and isinstance(samples[0], list):
            samples = list(itertools.chain.from_iterable(samples))
        self.metrics = dict(out.metrics or {})
        data = samples_to_train_data(self.args, samples)
        return split_by_dp(self.args, data, self.train_parallel_config)

    def get_metrics(self) -> dict[str, float]:
        """The last rollout's metrics (reward, accuracy, response length, truncated)."""
        return self.metrics

    def eval(self, rollout_id: int) -> dict[str, float]:
        out = _base_types.call_rollout_fn(
            self.eval_generate_rollout, self.args, rollout_id, self.data_source, evaluation=True
        )
        return dict(out.metrics or {})

    def get_num_rollout_per_epoch(self) -> int:
        return len(self.data_source) // self.args.rollout_batch_size

    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        self.data_source.load(rollout_id)

    # ---- colocated memory -------------------------------------------------------------------------
    def offload(self) -> None:
        import ray

        ray.get([e.release_memory_occupation.remote() for e in self.engines])

    def onload(self, tags: list[str] | None = None) -> None:
        import ray

        ray.get([e.resume_memory_occupation.remote(tags) for e in self.engines])

    def onload_weights(self) -> None:
        self.onload(["weights"])

    def onload_kv(self) -> None:
        self.onload(["kv_cache"])

    def dispose(self) -> None:
        if self.engine_group is not None:
            self.engine_group.stop()
            self.engine_group = None
