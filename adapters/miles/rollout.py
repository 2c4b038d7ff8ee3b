"""The rollout side of ``python -m adapters.miles.train``: :class:`TitanRolloutManager`.

miles' ``RolloutManager`` (``miles.ray.rollout.rollout_manager``) imports ``sglang`` at the
top and starts SGLang servers itself; neither runs on a CPU machine. This manager has the
methods miles' loop, its ``RayTrainGroup`` and the train actors call (``generate``,
``eval``, ``save``, ``load``, ``get_updatable_engines_and_lock``,
``clear_updatable_has_new_engines``, ``set_weight_version``, ``set_train_parallel_config``,
``health_monitoring_pause``, ``offload`` / ``onload``, ``dispose``); its engines are Titan's
(the built-in CPU engine or SGLang servers, ``titan_rl.actors``), or with
``--rollout-external`` the servers at ``--rollout-external-engine-addrs``.

Samples become train data with miles' own code, as miles' manager does it:
``postprocess_rollout_data`` (flatten, trim to whole global batches),
``convert_samples_to_train_data`` (per-group reward normalization, loss masks, rollout ids;
``--custom-reward-post-process-path`` / ``--custom-convert-samples-to-train-data-path``
honoured) and ``split_train_data_by_dp`` into miles' object store (its DP / micro-batch
schedule from the trainer's ``train_parallel_config``). Hooks are loaded with miles'
``load_function``.

miles' debug dumps (``--dump-details``) are written by miles' own functions
(``miles.ray.rollout.debug_data``) at the points miles' manager writes them.
``--use-fault-tolerance`` (miles' ``rollout`` component): Titan's engine supervisor restarts
a dead engine; :meth:`TitanRolloutManager.recover_updatable_engines` reports it new before
the next weight update.

``EnginesAndLock`` is defined only in the sglang-importing module above; no other miles
module exposes it. :func:`engines_and_lock` answers miles' class where that module imports
(sglang installed), else an object with the same five fields built from miles' own parts
(engine actors, miles' ``Lock`` actor).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from adapters.common.rollout import TitanEngines
from adapters.peers import PeerImportError, import_peer

_misc = import_peer("miles.utils.misc")
_debug_data = import_peer("miles.ray.rollout.debug_data")
_object_store = import_peer("miles.utils.object_store")
_ray_utils = import_peer("miles.ray.utils")
_rollout_conv = import_peer("miles.ray.rollout.rollout_data_conversion")
_train_conv = import_peer("miles.ray.rollout.train_data_conversion")

#: the fields of miles' ``EnginesAndLock`` (miles/ray/rollout/rollout_manager.py)
ENGINES_AND_LOCK_FIELDS = (
    "rollout_engines", "rollout_engine_lock", "has_new_engines", "engine_gpu_counts",
    "engine_gpu_offsets",
)  # fmt: skip


@functools.cache
def _engines_and_lock_cls() -> Any:
    try:
        return import_peer("miles.ray.rollout.rollout_manager").EnginesAndLock
    except PeerImportError:  # no sglang: miles' module (and class) cannot be imported
        return None


def engines_and_lock(
    rollout_engines: list[Any],
    rollout_engine_lock: Any,
    has_new_engines: bool,
    engine_gpu_counts: list[int],
    engine_gpu_offsets: list[int],
) -> Any:
    """miles' ``EnginesAndLock`` (where importable), else a namespace of its fields."""
    fields = dict(
        rollout_engines=list(rollout_engines),
        rollout_engine_lock=rollout_engine_lock,
        has_new_engines=bool(has_new_engines),
        engine_gpu_counts=list(engine_gpu_counts),
        engine_gpu_offsets=list(engine_gpu_offsets),
    )
    cls = _engines_and_lock_cls()
    return SimpleNamespace(**fields) if cls is None else cls(**fields)


def _load(path: str | None) -> Any:
    return _misc.load_function(path) if path else None


class TitanRolloutManager(TitanEngines):
    """miles' rollout-manager surface over Titan's engines (a Ray actor in the driver)."""

    def __init__(self, args: Any, pg: Any = None) -> None:
        super().__init__(args, pg)
        _object_store.init_instance(args, contribute_segment=False)
        self.data_source = _misc.load_function(args.data_source_path)(args)
        self.generate_rollout = _misc.load_function(args.rollout_function_path)
        self.eval_generate_rollout = _misc.load_function(args.eval_function_path)
        self.reward_post_process = _load(args.custom_reward_post_process_path)
        self.convert_samples = _load(args.custom_convert_samples_to_train_data_path)
        self.lock = _ray_utils.Lock.options(num_cpus=0).remote()
        self.weight_version: int | None = None
        self.has_new_engines = False
        #: engine restarts by their supervisors already reported (recover_updatable_engines)
        self.restarts_seen = 0

    # ---- engines ------------------------------------------------------------------------------
    def start_engines(self, model_path: str) -> list[str]:
        """``--rollout-num-gpus / --rollout-num-gpus-per-engine`` Titan engines serving
        ``model_path`` (or the ``--rollout-external`` ones); miles' router address args
        point at them. Returns their URLs."""
        args = self.args
        if args.rollout_external:
            urls = [a if "://" in a else f"http://{a}" for a in args.rollout_external_engine_addrs]
            url = urls[0]
        else:
            urls, url = self.start_titan_engines(model_path)
        self.serve(urls, url)
        self.has_new_engines = True
        _dump_tokenizer(args, model_path)
        return urls

    def get_router_address(self) -> tuple[str, int]:
        return self.args.sglang_router_ip, self.args.sglang_router_port

    def get_updatable_engines_and_lock(self) -> Any:
        """miles' ``EnginesAndLock`` of the engines the trainer updates."""
        counts, offsets = self.engine_gpus()
        return engines_and_lock(self.engines, self.lock, self.has_new_engines, counts, offsets)

    def clear_updatable_has_new_engines(self) -> None:
        self.has_new_engines = False

    def recover_updatable_engines(self) -> None:
        """miles' rollout fault tolerance (``--use-fault-tolerance``: miles' group calls this
        before each weight update). Titan's supervisor has restarted a dead engine already
        (at its URL, on the start-up weights); one restarted since the last call makes
        ``has_new_engines`` true, so the update reconnects and sends it the current
        weights. An engine whose supervisor gave up restarting it is an error naming it;
        external engines (``--rollout-external``) are not restarted by this run."""
        group = self.engine_group
        if group is None:
            return
        lost = group.gave_up()
        if lost:
            raise RuntimeError(
                f"rollout engines {lost} died and their supervisors stopped restarting them "
                "(max_restarts); the run resumes from --save when restarted"
            )
        restarts = group.restarts()
        if restarts != self.restarts_seen:
            self.restarts_seen = restarts
            self.has_new_engines = True

    def health_monitoring_pause(self) -> None:
        """miles pauses its engine health monitors around a weight update; none run here."""

    def get_weight_version(self) -> int | None:
        """The version rank 0 reported after the last weight update."""
        return self.weight_version

    def check_weights(self, action: str, **_: Any) -> list[Any]:
        raise NotImplementedError(
            "--check-weight-update-equal is not supported with Titan's engines; Titan's weight "
            "sync checks engine-vs-trainer logprob parity instead (sync.check_every)"
        )

    # ---- rollouts -------------------------------------------------------------------------------
    def generate(self, rollout_id: int) -> dict[str, Any]:
        """One rollout: samples -> miles' train data -> miles' object store; miles'
        ``rollout_data_pack`` (``sample_indices``, ``data_ref``)."""
        if self.train_parallel_config is None:
            raise RuntimeError("generate() before the train actors reported their layout")
        out = self.generate_rollout(self.args, rollout_id, self.data_source, evaluation=False)
        samples = getattr(out, "samples", out)
        self.metrics = dict(getattr(out, "metrics", None) or {})
        self.metrics.update(self.engine_metrics())  # restarts, resyncs, stale samples resent
        data, metadata = _rollout_conv.postprocess_rollout_data(
            self.args, samples, train_parallel_config=self.train_parallel_config
        )
        _debug_data.save_debug_rollout_data(
            self.args, data, rollout_id=rollout_id, evaluation=False, metadata=metadata
        )
        train_data = _train_conv.convert_samples_to_train_data(
            self.args,
            data,
            metadata=metadata,
            custom_convert_samples_to_train_data_func=self.convert_samples,
            custom_reward_post_process_func=self.reward_post_process,
        )
        if self.args.delay_split_train_data_by_dp:
            ref = _object_store.get_instance().put(
                value=train_data, value_spec=_train_conv.ROLLOUT_DATA_VALUE_SPEC
            )
        else:
            ref = _train_conv.split_train_data_by_dp(
                self.args, train_data, self.train_parallel_config
            )
        return {"sample_indices": train_data.get("sample_indices"), "data_ref": ref}

    def eval(self, rollout_id: int) -> dict[str, float]:
        out = self.eval_generate_rollout(self.args, rollout_id, self.data_source, evaluation=True)
        if getattr(out, "data", None) is not None:
            _debug_data.save_debug_rollout_data(
                self.args, out.data, rollout_id=rollout_id, evaluation=True
            )
        return dict(getattr(out, "metrics", None) or {})

    def save(self, rollout_id: int) -> None:
        if self.args.rollout_global_dataset:
            self.data_source.save(rollout_id)


def _dump_tokenizer(args: Any, model_path: str) -> None:
    """``--dump-details``: the tokenizer beside the dumps, as miles' data source saves it."""
    if getattr(args, "dump_details", None) is None or not Path(model_path).is_dir():
        return
    if not any(
        (Path(model_path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return
    tok = import_peer("miles.utils.processing_utils").load_tokenizer(
        model_path, chat_template_path=args.chat_template_path, trust_remote_code=True
    )
    tok.save_pretrained(Path(args.dump_details) / "tokenizer")
