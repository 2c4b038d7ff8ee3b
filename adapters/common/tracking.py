"""The drivers' metrics through slime's / miles' own tracking: each record that
``python -m adapters.slime.train`` / ``adapters.miles.train`` writes to ``metrics.jsonl``
also goes to the trackers their flags turn on, through the framework's own functions
(slime: ``slime.observability.logging_utils``; miles: ``miles.utils.tracking_utils.tracking``):
wandb (``--use-wandb``, ``--wandb-mode offline``), TensorBoard (``--use-tensorboard``), and in
miles MLflow (``--use-mlflow``) and Prometheus (``--use-prometheus``).

Names are the record's keys (``step`` excepted); each record is logged as slime logs its own,
in groups with slime's step keys: ``eval/*`` with ``eval/step``, ``train/*`` with
``train/step``, the rest with ``rollout/step``. The steps are slime's: ``rollout/step`` and
``eval/step`` the rollout's id (``metrics.jsonl``'s step - 1; the eval before RL at 0), or
slime's train step under ``--wandb-always-use-train-step``; ``train/step`` the rollout's first
optimizer step (rollout id x samples per rollout / ``--global-batch-size``).
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from pathlib import Path
from typing import Any

#: the framework's tracking module, metric helpers and TensorBoard writer
_MODULES = {
    "slime": (
        "slime.observability.logging_utils",
        "slime.observability.metric_utils",
        "slime.observability.tensorboard_utils",
    ),
    "miles": (
        "miles.utils.tracking_utils.tracking",
        "miles.utils.metric_utils",
        "miles.utils.tracking_utils.tensorboard_utils",
    ),
}


class Tracking:
    """The framework's trackers for one driver run: :meth:`log` each record, then
    :meth:`finish` once."""

    def __init__(self, args: Any, framework: str, run_dir: Path) -> None:
        """Starts the trackers ``args`` turns on (the driver's process is slime's primary)."""
        from adapters.peers import PeerImportError, import_peer
        from titan_core.config import ConfigError

        self.args, self.framework = args, framework
        track_mod, metric_mod, tb_mod = _MODULES[framework]
        self._track = import_peer(track_mod)
        self._metrics = import_peer(metric_mod)
        #: slime's / miles' TensorBoard writer: one per process (their ``SingletonMeta``)
        self._tb = import_peer(tb_mod)._TensorboardAdapter
        if not hasattr(args, "rank"):  # Megatron's parser sets it (RANK); the driver is rank 0
            args.rank = int(os.environ.get("RANK", "0"))
        if args.use_wandb and args.wandb_group is None:  # slime's run name needs a group
            args.wandb_group = run_dir.name
        if args.use_wandb and framework == "slime":
            _wandb_generate_id()
        if args.use_tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise PeerImportError(
                "--use-tensorboard: torch.utils.tensorboard needs the tensorboard package: "
                "pip install tensorboard (or `pip install -e .[peers]`)"
            )
        mlflow_uri = getattr(args, "mlflow_tracking_uri", None) or os.environ.get(
            "MLFLOW_TRACKING_URI", ""
        )
        if getattr(args, "use_mlflow", False) and mlflow_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
        try:
            self._track.init_tracking(args, primary=True)
            if framework == "slime" and args.use_tensorboard:  # slime opens it at first log
                self._tb(args)
        except ValueError as e:  # e.g. TensorBoard with no --tb-project-name nor TENSORBOARD_DIR
            raise ConfigError(f"{framework}'s tracking: {e}") from e

    def groups(self, rec: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
        """``rec`` as slime logs its own: ``(metrics, step key)`` per group."""
        args = self.args
        rollout_id = max(int(rec.get("step", 0)) - 1, 0)
        rollout_step = self._metrics.compute_rollout_step(args, rollout_id)
        per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
        train_step = rollout_id * per_rollout // (args.global_batch_size or per_rollout)
        parts: dict[str, dict[str, Any]] = {"rollout/step": {}, "train/step": {}, "eval/step": {}}
        by_prefix = {"train": "train/step", "eval": "eval/step"}
        for key, value in rec.items():
            if key != "step" and isinstance(value, numbers.Real):
                parts[by_prefix.get(key.split("/")[0], "rollout/step")][key] = value
        steps = {"rollout/step": rollout_step, "train/step": train_step, "eval/step": rollout_step}
        return [({**m, k: steps[k]}, k) for k, m in parts.items() if m]

    def log(self, rec: dict[str, Any]) -> None:
        """One driver record to every tracker on (nothing when none is)."""
        for metrics, step_key in self.groups(rec):
            self._track.log(self.args, metrics, step_key=step_key)

    def finish(self) -> None:
        """Ends the trackers (wandb's run, TensorBoard's file, MLflow's run)."""
        if self.framework == "slime":
            self._track.finish_tracking(self.args)
        else:
            self._track.finish_tracking()
        writer = self._tb._instances.pop(self._tb, None)  # a later run opens its own folder
        if writer is not None:
            writer.finish()


def _wandb_generate_id() -> None:
    """``wandb.util.generate_id``, which slime's run-name suffix calls, where wandb (0.28.2 on)
    keeps it only as ``wandb.sdk.lib.runid.generate_id`` (slime issue #2332; miles calls the
    latter)."""
    import wandb.util

    if not hasattr(wandb.util, "generate_id"):
        from wandb.sdk.lib.runid import generate_id

        wandb.util.generate_id = generate_id
