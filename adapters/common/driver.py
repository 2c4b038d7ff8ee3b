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
    """The Titan config, with what the framework's args leave to it filled in on ``args``;
    the flags with no effect here named in one start-up line each."""
    from adapters.common.config import mirror_config, titan_config_from_args

    if args.titan_config:  # absolute: Ray workers start elsewhere
        args.titan_config = str(Path(args.titan_config).resolve())
    for line in getattr(args, "titan_no_effect", []):
        print(f"no effect here: {line}", flush=True)
    for flag in ("prompt_data", "hf_checkpoint", "ref_load", "load", "save"):
        if getattr(args, flag, None):  # Ray workers start in other folders
            setattr(args, flag, str(Path(getattr(args, flag)).resolve()))
    if args.save:
        _check_writable(args.save, "--save")
    cfg = titan_config_from_args(args)
    cfg = _without_local_sequence_parallel(args, cfg)
    mirror_config(args, cfg)
    if args.rollout_max_response_len is None:
        args.rollout_max_response_len = cfg.rollout.max_response_len
    if args.rollout_stop_token_ids is None and cfg.data.type == "arithmetic":
        from titan_core.data.tokenizer import build_tokenizer

        # the arithmetic task's answers end at a newline or the end of text, as in titan_rl
        eod = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model).eod
        args.rollout_stop_token_ids = [10, eod]
    return cfg


def _without_local_sequence_parallel(args: Any, cfg: Any) -> Any:
    """``--sequence-parallel`` where the layers are megatron-core's local ones (no Transformer
    Engine: a CPU machine), whose torch norms cannot split the sequence: the run goes on
    without it (the same numbers; sequence parallelism only splits activation memory over
    the TP ranks), said in one start-up line."""
    from adapters.common.config import titan_config_from_args
    from titan_core.accelerator import get_accelerator
    from titan_core.models.gpt import use_transformer_engine

    if not cfg.parallel.sequence_parallel or use_transformer_engine(cfg, get_accelerator()):
        return cfg
    print("no effect here: --sequence-parallel: megatron-core's local layers (no Transformer "
          "Engine here) cannot split the sequence over TP ranks; the same step runs without "
          "it", flush=True)  # fmt: skip
    args.titan_overrides = [*(args.titan_overrides or []), "parallel.sequence_parallel=false"]
    return titan_config_from_args(args)


def _check_writable(path: str, flag: str) -> None:
    """``flag``'s folder can be made and written, checked before any work."""
    from titan_core.config import ConfigError

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".titan_write_probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be written ({e.strerror}); choose a folder "
                          "this user can write") from None  # fmt: skip


def colocated_offload(args: Any) -> bool:
    """Whether the trainer sleeps while the engines generate (``--offload-train``, which
    ``--colocate`` implies). slime's and miles' train groups start each rank under
    torch_memory_saver's LD_PRELOAD hook for it; where torch_memory_saver is not installed
    (a CPU machine) the framework's group is told no (``args.offload_train`` False) and
    Titan's ``sleep`` moves the trainer's tensors to host memory instead."""
    import importlib.util

    wanted = bool(args.offload_train)
    if wanted and importlib.util.find_spec("torch_memory_saver") is None:
        args.offload_train = False
    return wanted


def ray_init(args: Any) -> None:
    """A local Ray; on a CPU machine with the logical GPUs the placement groups ask for
    (one per trainer rank and engine device: they are bundles, not devices). Its workers
    get ``TITAN_CONFIG`` = the run's Titan file (the MUSA bootstrap reads the switches
    there), slime's ``SLIME_ACCELERATOR=titan`` unless the environment says otherwise, and,
    where slime is installed, the job's ``worker_process_setup_hook`` that registers
    ``titan`` in each worker's slime registry (``adapters.slime.runtime_env``)."""
    import ray

    from adapters.common.config import CONFIG_ENV
    from adapters.slime.runtime_env import runtime_env, slime_installed
    from titan_core.accelerator import get_accelerator

    if ray.is_initialized():
        return
    if args.titan_config:
        os.environ[CONFIG_ENV] = args.titan_config
    os.environ.setdefault("SLIME_ACCELERATOR", "titan")
    actor = args.actor_num_nodes * args.actor_num_gpus_per_node
    need = max(actor, args.rollout_num_gpus) if args.colocate else actor + args.rollout_num_gpus
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if slime_installed():
        kwargs["runtime_env"] = runtime_env()
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
    if cfg.policy.format == "titan":
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
