"""Checks of a GRPO config that need more than the config itself, run before any work
(before the base is pretrained and before Ray starts), and warnings about settings that
cannot learn.

:func:`check_config` is what ``--dry-run`` runs too; :func:`check_machine` what only a run
on this machine needs (a dry run may show the plan of another machine's job).
"""

from __future__ import annotations

from pathlib import Path

from titan_core.checkpoint import CheckpointError, latest_iteration
from titan_core.checkpoint.dist import iteration_dir
from titan_core.checkpoint.megatron_lm import read_common
from titan_core.config import ConfigError
from titan_core.models.hf.readable import check_safetensors
from titan_rl.algo.estimators import GROUP_ESTIMATORS
from titan_rl.config import GRPOConfig
from titan_rl.placement import machine_plan
from titan_rl.rewards.config import RewardConfig
from titan_rl.rollout.engine_clients import engine_client_factory

#: the model keys that decide the checkpoint's tensors (the others, e.g. seq_length or
#: dropout, may differ between pretraining and RL)
SHAPE_KEYS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "normalization", "position_embedding_type", "swiglu", "add_bias_linear",
    "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights", "num_moe_experts",
    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
)  # fmt: skip


def saved_model_section(load: str | Path) -> dict | None:
    """The ``model`` section a Titan checkpoint was trained with (from its ``common.pt``,
    no tensor loaded), or None where there is no checkpoint or it records none."""
    iteration = latest_iteration(load)
    if iteration is None:
        return None
    common = read_common(iteration_dir(load, iteration) / "common.pt")
    return ((common.get("common") or {}).get("config") or {}).get("model")


def check_base_matches(cfg: GRPOConfig) -> None:
    """A ``model`` section that does not match the Titan base checkpoint is a ConfigError
    naming each key, before anything starts (the load would fail after Ray started)."""
    if cfg.policy.format != "titan":
        return
    try:
        saved = saved_model_section(cfg.policy.load)
    except CheckpointError as e:
        raise ConfigError(f"policy.load: {e}") from None
    if not saved:
        return
    ours = cfg.model.model_dump()
    diff = [
        f"model.{k}={ours.get(k)!r} (the checkpoint: {saved[k]!r})"
        for k in SHAPE_KEYS
        if k in saved and saved[k] != ours.get(k)
    ]
    if diff:
        raise ConfigError(
            f"the model section does not match the base checkpoint policy.load={cfg.policy.load}: "
            f"{'; '.join(diff)}; set these keys as the checkpoint has them (or point "
            "policy.load at the checkpoint this model section describes)"
        )


def check_base_dir(cfg: GRPOConfig) -> None:
    """The Titan base is not kept in this run's own checkpoints folder: RL saves its
    checkpoints and metrics in ``run.dir``, and a base pretrained there would run in the
    ``run.dir`` this job holds locked (titan_core.run_lock)."""
    own = Path(cfg.run.dir) / "checkpoints"
    if cfg.policy.format == "titan" and Path(cfg.policy.load).resolve() == own.resolve():
        raise ConfigError(
            f"policy.load {cfg.policy.load} is this run's own checkpoints folder (run.dir "
            f"{cfg.run.dir}), where RL saves its checkpoints and metrics; keep the base in a "
            "folder of its own (e.g. policy.load=runs/base/checkpoints), or choose another run.dir"
        )


def check_reward(cfg: RewardConfig) -> None:
    """Import ``reward.custom_path`` now, once (validating the config only checks its form),
    so a missing module or function is a ConfigError before anything starts."""
    try:
        cfg.load_custom()
    except ValueError as e:  # the message names reward.custom_path
        raise ConfigError(str(e)) from None


def check_generate_fn(cfg: GRPOConfig) -> None:
    """Import ``rollout.generate_fn`` now, so a missing module or a function that is not
    async is a ConfigError naming the key before anything starts."""
    if cfg.rollout.generate_fn is None:
        return
    from titan_rl.rollout.hooks import load_generate_fn

    try:
        load_generate_fn(cfg.rollout.generate_fn)
    except ValueError as e:  # the message names rollout.generate_fn
        raise ConfigError(str(e)) from None


def check_engine_client(cfg: GRPOConfig) -> None:
    """Load ``engines.client``'s factory now (a path or an entry point is imported; validating
    the config only checks its form), so a missing module or function is a ConfigError naming
    the key before anything starts."""
    try:
        engine_client_factory(cfg.engines.client)
    except ValueError as e:  # the message names engines.client
        raise ConfigError(str(e)) from None


def check_policy_files(cfg: GRPOConfig) -> None:
    """An HF policy's weight files can be read (``titan_core.models.hf.readable``): a
    truncated one is named now, not by the trainer's or the engines' load after Ray
    started."""
    if cfg.policy.format == "hf":
        check_safetensors(cfg.policy.load, "policy.load")


def check_config(cfg: GRPOConfig) -> None:
    """Everything of ``cfg`` beyond its own validation: the base checkpoint or HF policy's
    files, the run folder, the reward function, the engine client, the placement (what
    ``--dry-run`` prints)."""
    check_base_matches(cfg)
    check_policy_files(cfg)
    check_base_dir(cfg)
    check_reward(cfg.reward)
    check_generate_fn(cfg)
    check_engine_client(cfg)
    machine_plan(cfg, launching=False)


def check_machine(cfg: GRPOConfig) -> None:
    """What this machine must have to run ``cfg``: engines it can launch and what the weight
    sync's transport needs (``machine_problem`` of its section: the distributed transport's
    process-group backend, the mooncake transport's package)."""
    machine_plan(cfg, launching=True)
    problem = cfg.sync.settings.machine_problem()
    if problem:
        raise ConfigError(problem)


def learning_warnings(cfg: GRPOConfig) -> list[str]:
    """Settings that run but cannot learn, one line each."""
    out = []
    r, estimator = cfg.rollout, cfg.algo.advantage_estimator
    if r.temperature == 0 and estimator in GROUP_ESTIMATORS:
        out.append(
            f"rollout.temperature=0 with algo.advantage_estimator={estimator}: every sample of "
            "a prompt is the same greedy answer, so the group advantages are all zero and the "
            "policy does not change; use a temperature > 0 (e.g. 1.0)"
        )
    return out
