"""What ``python -m adapters.slime.train`` and ``python -m adapters.miles.train`` share
around their framework's loop: the Titan config and the args it fills, a local Ray, the
policy the run starts from, the status line and the reward plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: exit status of a user error (bad config, missing dataset or peer package), as titan_rl's
EXIT_CONFIG_ERROR = 2


def prepare(args: Any) -> Any:
    """The Titan config, with what the framework's args leave to it filled in on ``args``."""
    from adapters.common.config import titan_config_from_args

    if args.titan_config:  # absolute: Ray workers start elsewhere
        args.titan_config = str(Path(args.titan_config).resolve())
    cfg = titan_config_from_args(args)
    if args.micro_batch_size is None:  # the DP schedule packs micro-batches of this size
        args.micro_batch_size = cfg.train.micro_batch_size
    if args.rollout_max_response_len is None:
        args.rollout_max_response_len = cfg.rollout.max_response_len
    if args.rollout_stop_token_ids is None and cfg.data.type == "arithmetic":
        from titan_core.data.tokenizer import build_tokenizer

        # the arithmetic task's answers end at a newline or the end of text, as in titan_rl
        eod = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model).eod
        args.rollout_stop_token_ids = [10, eod]
    return cfg


def ray_init(args: Any) -> None:
    """A local Ray; on a CPU machine with the logical GPUs the placement groups ask for
    (one per trainer rank and engine device: they are bundles, not devices). Its workers
    inherit ``TITAN_CONFIG`` = the run's Titan file (the MUSA bootstrap reads the switches
    there) and slime's ``SLIME_ACCELERATOR=titan`` unless the environment says otherwise."""
    import ray

    from adapters.common.config import CONFIG_ENV
    from titan_core.accelerator import get_accelerator

    if ray.is_initialized():
        return
    if args.titan_config:
        os.environ[CONFIG_ENV] = args.titan_config
    os.environ.setdefault("SLIME_ACCELERATOR", "titan")
    actor = args.actor_num_nodes * args.actor_num_gpus_per_node
    need = max(actor, args.rollout_num_gpus) if args.colocate else actor + args.rollout_num_gpus
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if get_accelerator().device_type == "cpu":
        kwargs.update(num_gpus=need, num_cpus=max(os.cpu_count() or 1, 2 * need + 2))
    ray.init(**kwargs)


def status_line(rec: dict[str, Any], total: int) -> str:
    parts = [f"rollout {rec['step']:>4}/{total}"]
    for key, fmt in (
        ("reward/mean", "reward {:.3f}"),
        ("rollout/accuracy", "rollout acc {:.3f}"),
        ("response/length_mean", "len {:.1f}"),
        ("eval/accuracy", "eval acc {:.3f}"),
        ("train/pg_loss", "pg loss {:.4f}"),
    ):
        if key in rec:
            parts.append(fmt.format(rec[key]))
    parts.append(
        f"time {rec['time/step']:.2f}s (rollout {rec['time/rollout']:.2f} / train "
        f"{rec['time/train']:.2f} / sync {rec['time/sync']:.2f})"
    )
    return " | ".join(parts)


def start_policy(args: Any, cfg: Any) -> Path:
    """The run folder (``--metrics-dir`` or the Titan ``run.dir``), with the policy to start
    from: the demo's base is pretrained (on the same base) if ``policy.load`` is missing,
    and without ``--hf-checkpoint`` the engines start from the policy itself, which the
    first trainer rank exports to ``<run>/hf_start`` at ``init``."""
    from titan_rl.grpo import ensure_base_checkpoint

    run_dir = Path(args.metrics_dir or cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.load is None:
        ensure_base_checkpoint(cfg)
    if args.hf_checkpoint is None:
        args.hf_checkpoint = str((run_dir / "hf_start").resolve())
        args.titan_export_hf_checkpoint = True
    return run_dir


def finish_run(run_dir: Path, title: str) -> None:
    """``reward.png`` from ``metrics.jsonl``, and where both are."""
    from titan_core.training.metrics import read_metrics
    from titan_rl.plot import plot_rewards

    plot_rewards(read_metrics(run_dir / "metrics.jsonl"), run_dir / "reward.png", title=title)
    print(f"wrote {run_dir / 'metrics.jsonl'} and {run_dir / 'reward.png'}", flush=True)
