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

import itertools
from typing import Any

from adapters.common.rollout import TitanEngines, rollout_groups, summary
from adapters.peers import import_peer
from adapters.slime.train_data import samples_to_train_data, split_by_dp

_misc = import_peer("slime.utils.misc")
_base_types = import_peer("slime.rollout.base_types")
_types = import_peer("slime.utils.types")


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False):
    """slime's rollout function: one rollout's sample groups (or the evaluation set) through
    ``--custom-generate-function-path`` (default ``adapters.slime.generate.generate``), scored
    by ``--custom-rm-path``. Evaluation uses the source's ``eval_samples()`` (one response
    each, ``--eval-temperature`` / ``--eval-max-response-len``)."""
    path = args.custom_generate_function_path or "adapters.slime.generate.generate"
    generate = _misc.load_function(path)
    groups = rollout_groups(args, data_source, evaluation, generate, _misc.load_function)
    flat = [s for grp in groups for s in grp]
    metrics = summary(args, flat, evaluation, _types.Sample.Status.TRUNCATED)
    if evaluation:
        data = {"eval": {"rewards": [s.reward for s in flat], "samples": flat}}
        return _base_types.RolloutFnEvalOutput(data=data, metrics=metrics)
    return _base_types.RolloutFnTrainOutput(samples=groups, metrics=metrics)


class TitanRolloutManager(TitanEngines):
    """slime's rollout manager surface over Titan's engines (a Ray actor in the driver)."""

    def __init__(self, args: Any, pg: Any = None) -> None:
        super().__init__(args, pg)
        self.data_source = _misc.load_function(args.data_source_path)(args)
        self.generate_rollout = _misc.load_function(args.rollout_function_path)
        self.eval_generate_rollout = _misc.load_function(args.eval_function_path)
        self.lock: Any = None

    def start_engines(self, model_path: str) -> list[str]:
        """Start ``--rollout-num-gpus / --rollout-num-gpus-per-engine`` engines serving
        ``model_path``; slime's router address args point at them. Returns their URLs."""
        urls, url = self.start_titan_engines(model_path)
        self.serve(urls, url)
        self.lock = import_peer("slime.ray.utils").Lock.options(num_cpus=0).remote()
        return urls

    def get_updatable_engines_and_lock(self) -> tuple:
        """slime's tuple: engines, lock, new engines, GPUs per engine, GPU offsets, configs."""
        counts, offsets = self.engine_gpus()
        configs = [{"tp_size": c} for c in counts]
        return self.engines, self.lock, 0, counts, offsets, configs

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

    def eval(self, rollout_id: int) -> dict[str, float]:
        out = _base_types.call_rollout_fn(
            self.eval_generate_rollout, self.args, rollout_id, self.data_source, evaluation=True
        )
        return dict(out.metrics or {})

    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)
