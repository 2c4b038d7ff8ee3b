"""The GRPO config: policy (Megatron sections shared with pretraining), rollout, algorithm,
reward, sync, data and run. Unknown keys and bad values are errors naming the key."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from titan_core.config import Section
from titan_core.config.pretrain import (
    DataConfig as PretrainDataConfig,
)
from titan_core.config.pretrain import (
    ModelConfig,
    ParallelConfig,
    PretrainConfig,
    ProfileConfig,
    TrainConfig,
)
from titan_rl.algo.config import AlgoConfig
from titan_rl.rewards.config import RewardConfig
from titan_rl.sync.config import SyncConfig


class PolicyConfig(Section):
    """Where the policy starts."""

    #: "titan": a Titan checkpoint folder (holding latest_checkpointed_iteration.txt);
    #: "hf": an HF safetensors directory (Llama / Qwen2 / Qwen3 / Qwen3-MoE).
    format: Literal["titan", "hf"] = "titan"
    load: str = "runs/math_base/checkpoints"
    #: When a Titan checkpoint is missing: pretrain it first with this titan_core.pretrain
    #: config (+ overrides), on the same training base. None: missing is an error.
    pretrain_config: str | None = None
    pretrain_overrides: list[str] = Field(default_factory=list)


class RolloutConfig(Section):
    prompts_per_step: PositiveInt = 32
    n_samples_per_prompt: PositiveInt = 8
    max_response_len: PositiveInt = 8
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    #: sample this many times more prompts; with ``dynamic_filter`` the groups whose
    #: rewards all agree are dropped, and the first ``prompts_per_step`` groups kept.
    over_sample_factor: float = Field(1.0, ge=1.0)
    dynamic_filter: bool = False
    #: rollout of step k+1 runs while step k trains (one-step off-policy).
    async_rollout: bool = Field(False, alias="async")
    max_concurrency: PositiveInt = 256
    #: a response generated with another weight version than the policy's (an engine that
    #: was restarted on the start-up weights and not yet given the current ones): "resend"
    #: refuses it and sends the request again once the engines serve the current weights;
    #: "keep" keeps it (off-policy). Both count it in ``rollout/stale_samples``.
    on_stale_version: Literal["resend", "keep"] = "resend"

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.top_k == 0 or self.top_k < -1:  # the engines' rule (SGLang's and the built-in)
            raise ValueError(
                f"rollout.top_k={self.top_k}: use -1 (the whole vocabulary) or at least 1"
            )
        return self


class EnginesConfig(Section):
    """Rollout engines: built-in on CPU, SGLang on GPUs."""

    backend: Literal["auto", "sglang", "builtin"] = "auto"
    num_engines: PositiveInt = 1
    tp_size: PositiveInt = 1
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    #: colocated: trainer and engines share devices (engines release memory while training).
    colocate: bool = False
    router: bool = False
    num_threads: PositiveInt | None = 1
    api_key: str | None = None
    #: how long requests to engines that do not answer (connection refused or reset, 5xx)
    #: are sent again, from the first failure, and how long a restarted engine may take to
    #: serve the current weights: it must cover a restart (the built-in engine: ~20 s on 2
    #: busy cores; SGLang loading a large model: minutes).
    retry_timeout_s: float = Field(900.0, gt=0)


class RLDataConfig(Section):
    #: arithmetic: generated a+b= problems (exact-match reward); jsonl / parquet: a file
    #: with ``prompt_key`` and ``label_key`` columns.
    type: Literal["arithmetic", "jsonl", "parquet"] = "arithmetic"
    path: str | None = None
    eval_path: str | None = None
    prompt_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = False
    num_digits: PositiveInt = 3
    #: arithmetic: "plain" (57+8=65) or "aligned" (57+08=560: padded, sum reversed).
    arithmetic_format: Literal["plain", "aligned"] = "plain"
    num_eval: PositiveInt = 500
    tokenizer_type: Literal["byte", "hf"] = "byte"
    tokenizer_model: str | None = None

    @model_validator(mode="after")
    def _check(self) -> RLDataConfig:
        if self.type != "arithmetic" and not self.path:
            raise ValueError(f"data.path is required for data.type={self.type}")
        if self.tokenizer_type == "hf" and not self.tokenizer_model:
            raise ValueError("data.tokenizer_model is required for data.tokenizer_type=hf")
        return self


class RLRunConfig(Section):
    dir: str = "runs/grpo"
    num_steps: PositiveInt = 200
    eval_interval: PositiveInt = 20
    save_interval: int = Field(100, ge=0)
    #: on SIGTERM / SIGINT, save the last completed step before exiting 143 / 130 (as
    #: Megatron-LM's --exit-signal-handler does); false: exit without saving.
    save_on_signal: bool = True
    seed: int = 1
    log_interval: PositiveInt = 1


class RayConfig(Section):
    #: None: a local Ray started for this run (RAY_ADDRESS is not consulted); else an existing
    #: cluster's address ("auto", "host:6379", "ray://host:10001"), whose resources are its own.
    address: str | None = None
    #: local Ray only: logical CPUs (None: max(2, cpu count, the placement's CPU bundles)).
    num_cpus: PositiveInt | None = None
    #: Ray namespace of the job's actors (None: Ray's anonymous one).
    namespace: str | None = None

    @model_validator(mode="after")
    def _check(self) -> RayConfig:
        if self.address is not None and self.num_cpus is not None:
            raise ValueError(
                "ray.num_cpus applies to a local Ray only; an existing cluster (ray.address) "
                "brings its own resources, so unset ray.num_cpus"
            )
        return self


class GRPOConfig(Section):
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(
        default_factory=lambda: TrainConfig(
            lr=1e-4, min_lr=1e-4, lr_warmup_iters=0, lr_decay_style="constant", weight_decay=0.0,
            micro_batch_size=64, global_batch_size=256, train_iters=10**9,
        )
    )  # fmt: skip
    #: policy-update passes over each rollout batch (PPO epochs).
    ppo_steps: PositiveInt = 1
    #: Megatron trainer processes (TP x PP x CP x DP); each is a Ray actor.
    trainer_processes: PositiveInt = 1
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    data: RLDataConfig = Field(default_factory=RLDataConfig)
    run: RLRunConfig = Field(default_factory=RLRunConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    #: profiler traces of these RL steps, one file per trainer rank (``<run.dir>/traces``):
    #: ProfilerStep#N with titan/rl/{rollout,train,sync} and microbatch ranges inside.
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        batch = self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt
        if batch % self.train.micro_batch_size:
            raise ValueError(
                f"rollout.prompts_per_step x n_samples_per_prompt ({batch}) must be divisible by "
                f"train.micro_batch_size ({self.train.micro_batch_size})"
            )
        if self.algo.advantage_estimator in ("grpo", "dr_grpo", "gspo", "rloo") and (
            self.rollout.n_samples_per_prompt < 2
        ):
            raise ValueError(
                f"algo.advantage_estimator={self.algo.advantage_estimator} compares samples of "
                "a prompt: set rollout.n_samples_per_prompt >= 2"
            )
        return self

    def pretrain_view(self, world_size: int) -> PretrainConfig:
        """The titan_core config the Megatron trainer is built from (same base as pretraining)."""
        batch = self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt
        train = self.train.model_copy(update={"global_batch_size": batch})
        return PretrainConfig(
            model=self.model,
            parallel=self.parallel,
            train=train,
            data=PretrainDataConfig(
                tokenizer_type=self.data.tokenizer_type, tokenizer_model=self.data.tokenizer_model
            ),
            run={"dir": self.run.dir},
        )
