"""What ``python -m adapters.slime.train`` and ``python -m adapters.miles.train`` share
around their framework's loop: the Titan config and the args it fills, a local Ray, the
policy the run starts from, the status line and the reward plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: exit status of a user error (bad config, missing dataset or peer package), as titan_rl's
EXIT_CONFIG_ERROR = 2
#: exit status of a run a user's code stopped (an invalid reward, too many reward timeouts)
EXIT_RUN_ERROR = 1


def prepare(args: Any) -> Any:
    """The Titan config, with what the framework's args leave to it filled in on ``args``;
    the flags with no effect here named in one start-up line each."""
    from adapters.common.config import mirror_config, titan_config_from_args
    from titan_core.models.hf.readable import check_safetensors

    if args.titan_config:  # absolute: Ray workers start elsewhere
        args.titan_config = str(Path(args.titan_config).resolve())
    for line in getattr(args, "titan_no_effect", []):
        print(f"no effect here: {line}", flush=True)
    for flag in ("prompt_data", "hf_checkpoint", "ref_load", "load", "save"):
        if getattr(args, flag, None):  # Ray workers start in other folders
            setattr(args, flag, str(Path(getattr(args, flag)).resolve()))
    if args.save:
        _check_writable(args.save, "--save")
    if args.hf_checkpoint:  # read by the engines and, on a fresh run, the trainer ranks
        check_safetensors(args.hf_checkpoint, "--hf-checkpoint")
    cfg = titan_config_from_args(args)
    if cfg.ray != type(cfg.ray)():  # the Titan YAML's ray section: the GRPO job's placement
        print("no effect here: the Titan YAML's ray section (ray.address, ray.*_resources): "
              "the framework starts Ray and places its actors itself (--actor-num-nodes, "
              "--rollout-num-gpus, ...)", flush=True)  # fmt: skip
    cfg = _without_local_only_kernels(args, cfg)
    mirror_config(args, cfg)
    _generated_flags(args, cfg)
    if args.rollout_max_response_len is None:
        args.rollout_max_response_len = cfg.rollout.max_response_len
    if args.rollout_stop_token_ids is None and cfg.data.type == "arithmetic":
        from titan_core.data.tokenizer import build_tokenizer

        # the arithmetic task's answers end at a newline or the end of text, as in titan_rl
        eod = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model).eod
        args.rollout_stop_token_ids = [10, eod]
    return cfg


#: kernel switches a framework's script sets that megatron-core's local layers (no
#: Transformer Engine: a CPU machine) cannot run, and why the run is the same without them
_KERNEL_ONLY = {
    "sequence_parallel": (
        "parallel",
        "--sequence-parallel",
        "megatron-core's local layers (no Transformer Engine here) cannot split the sequence "
        "over TP ranks; the same step runs without it (it only splits activation memory)",
    ),
    "moe_grouped_gemm": (
        "model",
        "--moe-grouped-gemm",
        "no grouped-GEMM kernel here (Transformer Engine or the grouped_gemm package); the "
        "experts run one GEMM each, the same numbers",
    ),
}


def _without_local_only_kernels(args: Any, cfg: Any) -> Any:
    """Where the layers are megatron-core's local ones, the switches of :data:`_KERNEL_ONLY`
    are turned off for the run, each said in one start-up line."""
    import importlib.util

    from adapters.common.config import titan_config_from_args
    from titan_core.accelerator import get_accelerator
    from titan_core.models.transformer_impl import use_transformer_engine

    if use_transformer_engine(cfg, get_accelerator()):
        return cfg
    off = []
    for field, (section, flag, why) in _KERNEL_ONLY.items():
        if not getattr(getattr(cfg, section), field):
            continue
        if field == "moe_grouped_gemm" and importlib.util.find_spec("grouped_gemm"):
            continue
        print(f"no effect here: {flag}: {why}", flush=True)
        off.append(f"{section}.{field}=false")
    if not off:
        return cfg
    args.titan_overrides = [*(args.titan_overrides or []), *off]
    return titan_config_from_args(args)


def _generated_flags(args: Any, cfg: Any) -> None:
    """``--sglang-*`` / ``--router-*`` (sglang's and sglang-router's own options): kept on
    ``args`` for the engines' and the router's command lines
    (``adapters.common.rollout.TitanEngines``), each said in a start-up line where it
    cannot act (the built-in engine; one engine and so no router)."""
    from titan_core.accelerator import get_accelerator
    from titan_rl.actors.config import resolve_backend

    sglang = resolve_backend(cfg.engines.backend, get_accelerator().device_type) == "sglang"
    engines = max(1, args.rollout_num_gpus // args.rollout_num_gpus_per_engine)
    for flag in getattr(args, "titan_generated_flags", {}):
        if flag.startswith("--sglang-") and not sglang:
            print(f"no effect here: {flag}: the built-in engine (CPU) has no such setting; "
                  "SGLang servers get it as --" + flag.removeprefix("--sglang-"), flush=True)  # fmt: skip
        elif flag.startswith("--router-") and engines == 1:
            print(f"no effect here: {flag}: one engine, so no router runs", flush=True)


def generated_args(args: Any, prefix: str) -> list[str]:
    """The ``prefix`` family's flags given, as the sglang / sglang-router command line
    takes them (``--sglang-mem-fraction-static 0.7`` -> ``--mem-fraction-static 0.7``)."""
    out: list[str] = []
    for flag, values in (getattr(args, "titan_generated_flags", None) or {}).items():
        if flag.startswith(prefix):
            out += ["--" + flag.removeprefix(prefix), *values]
    return out


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


def engines_start_beside_trainers(args: Any) -> bool:
    """Whether the engines are launched while the trainer ranks start, so that the two
    start-ups (seconds of imports and model loads each) overlap. Not where the engines serve
    the policy that the first trainer rank exports at ``init`` (no ``--hf-checkpoint``), nor
    where colocated engines share a device's memory with the trainers (``--colocate`` on a
    GPU): those start after the trainers, as before."""
    from titan_core.accelerator import get_accelerator

    if getattr(args, "titan_export_hf_checkpoint", False):
        return False
    return not args.colocate or get_accelerator().device_type == "cpu"


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
    from titan_rl.placement import init_ray, local_ray_settings

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
    # a Ray this driver starts gets the main job's settings (no workers prestarted, workers
    # at the driver's niceness: titan_rl.placement.local_ray_settings), which Ray reads as
    # RAY_<setting> where it starts a node; a running cluster keeps its own. Only settings
    # whose variable the user left unset come back, so the start's variables are just removed.
    settings = {f"RAY_{k}": json.dumps(v) for k, v in local_ray_settings().items()}
    os.environ.update(settings)
    try:
        init_ray(**kwargs)  # tried again where a busy machine misses Ray's start-up window
    finally:
        for name in settings:
            os.environ.pop(name, None)


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
    """The run folder (``--metrics-dir`` or the Titan ``run.dir``; without ``--save``,
    checkpoints go to ``<run.dir>/checkpoints``), with the policy to start from: the demo's base is pretrained (on the same base) if ``policy.load`` is missing,
    and without ``--hf-checkpoint`` the engines start from the policy itself, which the
    first trainer rank exports to ``<run>/hf_start`` at ``init``."""
    from titan_rl.grpo import ensure_base_checkpoint

    run_dir = Path(args.metrics_dir or cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.save is None:  # checkpoints and the prompts' position, where a rerun resumes
        args.save = str((Path(cfg.run.dir) / "checkpoints").resolve())
        _check_writable(args.save, "run.dir")
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
