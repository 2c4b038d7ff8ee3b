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

import copy
import itertools
from typing import Any

from adapters.common.rollout import TitanEngines, eval_data, rollout_groups, summary
from adapters.peers import import_peer
from adapters.slime.train_data import samples_to_train_data, split_by_dp

_misc = import_peer("slime.utils.misc")
_base_types = import_peer("slime.rollout.base_types")
_types = import_peer("slime.utils.types")
_debug = import_peer("slime.observability.rollout_data_utils")


def reward_function(args: Any) -> Any:
    """slime's own reward hub: ``--custom-rm-path`` where given, else ``--rm-type``
    (deepscaler, dapo, math, f1, gpqa, remote_rm, ...); batched with ``--group-rm``."""
    hub = import_peer("slime.rollout.rm_hub")
    return hub.batched_async_rm if args.group_rm else hub.async_rm


def eval_datasets(args: Any) -> list[tuple[str, list[Any]]]:
    """``--eval-prompt-data NAME PATH ...``: each set's prompts read by slime's own
    ``Dataset`` (``--eval-input-key`` / ``--eval-label-key`` / ``--eval-tool-key``, else the
    rollout's keys; the chat template and prompt length limit as for training)."""
    pairs = list(args.eval_prompt_data or [])
    if not pairs:
        return []
    data = import_peer("slime.utils.data")
    processing = import_peer("slime.utils.processing_utils")
    tokenizer = processing.load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
    out = []
    for name, path in zip(pairs[::2], pairs[1::2], strict=True):
        ds = data.Dataset(
            path,
            tokenizer=tokenizer,
            processor=None,
            max_length=args.eval_max_prompt_len or args.rollout_max_prompt_len,
            prompt_key=args.eval_input_key or args.input_key,
            multimodal_keys=None,
            label_key=args.eval_label_key or args.label_key,
            metadata_key=args.metadata_key,
            tool_key=args.eval_tool_key or args.tool_key,
            apply_chat_template=args.apply_chat_template,
            apply_chat_template_kwargs=args.apply_chat_template_kwargs,
            seed=args.rollout_seed,
        )
        out.append((name, list(ds.samples)))
    return out


def _eval_groups(args: Any) -> tuple[list[list[Any]], list[str]] | None:
    sets = eval_datasets(args)
    if not sets:
        return None
    groups, names = [], []
    index = 0
    for name, prompts in sets:
        for p in prompts:
            group = []
            for _ in range(args.n_samples_per_eval_prompt):
                s = copy.deepcopy(p)
                s.index, index = index, index + 1
                group.append(s)
            groups.append(group)
            names.append(name)
    return groups, names


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False):
    """slime's rollout function: one rollout's sample groups (or the evaluation sets) through
    ``--custom-generate-function-path`` (default ``adapters.slime.generate.generate``), scored
    by slime's reward hub. Evaluation: the ``--eval-prompt-data`` sets,
    ``--n-samples-per-eval-prompt`` responses each at the ``--eval-*`` sampling settings
    (``eval/<name>``: a set's mean reward), else the source's ``eval_samples()``."""
    path = args.custom_generate_function_path or "adapters.slime.generate.generate"
    generate = _misc.load_function(path)
    named = _eval_groups(args) if evaluation else None
    groups = rollout_groups(
        args, data_source, evaluation, generate, reward_function(args),
        eval_groups=named[0] if named else None,
    )  # fmt: skip
    flat = [s for grp in groups for s in grp]
    metrics = summary(args, flat, evaluation, _types.Sample.Status.TRUNCATED)
    if evaluation:
        data = eval_data(args, groups, named[1] if named else None, metrics)
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
        self.metrics.update(self.engine_metrics())  # restarts, resyncs, stale samples resent
        # slime's own dump (--save-debug-rollout-data), where slime's manager writes it
        _debug.save_debug_rollout_data(
            self.args.save_debug_rollout_data, samples, rollout_id=rollout_id, evaluation=False
        )
        data = samples_to_train_data(self.args, samples)
        return split_by_dp(self.args, data, self.train_parallel_config)

    def eval(self, rollout_id: int) -> dict[str, float]:
        out = _base_types.call_rollout_fn(
            self.eval_generate_rollout, self.args, rollout_id, self.data_source, evaluation=True
        )
        _debug.save_debug_rollout_data(
            self.args.save_debug_rollout_data, out.data, rollout_id=rollout_id, evaluation=True
        )
        return dict(out.metrics or {})

    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)
