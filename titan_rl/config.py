"""The GRPO config: policy (Megatron sections shared with pretraining), rollout, algorithm,
reward, sync, data and run. Unknown keys and bad values are errors naming the key."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, ValidationError, field_validator, model_validator

from titan_core.config import ConfigError, Section
from titan_core.config.pretrain import (
    ArithmeticFields,
    ModelConfig,
    ParallelConfig,
    PretrainConfig,
    ProfileConfig,
    TokenizerFields,
    TrainConfig,
    check_layout,
)
from titan_rl.algo.config import AlgoConfig
from titan_rl.algo.estimators import group_size_problem
from titan_rl.rewards.config import RewardConfig
from titan_rl.sync.config import SyncConfig
from titan_rl.user_code import split_spec


class PolicyConfig(Section):
    """Where the policy starts."""

    #: "titan": a Titan checkpoint folder (holding latest_checkpointed_iteration.txt);
    #: "hf": an HF safetensors directory (Llama / Qwen2 / Qwen3 / Qwen3-MoE).
    format: Literal["titan", "hf"] = "titan"
    #: the policy's weights: that folder or directory.
    load: str = "runs/math_base/checkpoints"
    #: When a Titan checkpoint is missing: pretrain it first with this titan_core.pretrain
    #: config (+ overrides), on the same training base. None: missing is an error.
    pretrain_config: str | None = None
    #: ``key.sub=value`` overrides of ``pretrain_config``.
    pretrain_overrides: list[str] = Field(default_factory=list)


class RolloutConfig(Section):
    #: prompts drawn per RL step.
    prompts_per_step: PositiveInt = 32
    #: responses generated per prompt (a group).
    n_samples_per_prompt: PositiveInt = 8
    #: the response budget in tokens.
    max_response_len: PositiveInt = 8
    #: sampling temperature (0: greedy).
    temperature: float = Field(1.0, ge=0)
    #: nucleus sampling: the smallest set of tokens holding this probability.
    top_p: float = Field(1.0, gt=0, le=1)
    #: sample from the k likeliest tokens (-1: the whole vocabulary).
    top_k: int = -1
    #: sample this many times more prompts; with ``dynamic_filter`` the groups whose
    #: rewards all agree are dropped, and the first ``prompts_per_step`` groups kept.
    over_sample_factor: float = Field(1.0, ge=1.0)
    #: drop groups whose rewards all agree (they carry no advantage), see above.
    dynamic_filter: bool = False
    #: rollout of step k+1 runs while step k trains (one-step off-policy).
    async_rollout: bool = Field(False, alias="async")
    #: generate requests in flight at once.
    max_concurrency: PositiveInt = 256
    #: a response generated with another weight version than the policy's (an engine that
    #: was restarted on the start-up weights and not yet given the current ones): "resend"
    #: refuses it and sends the request again once the engines serve the current weights;
    #: "keep" keeps it (off-policy). Both count it in ``rollout/stale_samples``.
    on_stale_version: Literal["resend", "keep"] = "resend"
    #: ask the engines for the experts each token was routed to in every MoE layer (SGLang's
    #: ``return_routed_experts``; SGLang engines are launched with
    #: ``--enable-return-routed-experts``); each sample carries them in
    #: ``rollout_routed_experts``. MoE models only (a dense model's engine refuses it).
    return_routed_experts: bool = False
    #: the rollout hook, ``"module:function"`` (or ``"path/to/file.py:function"``):
    #: ``async fn(ctx, sample, sampling_params) -> Sample | list[Sample]``, called once per
    #: sample (n=1, a sampling seed each), or once per prompt (n = n_samples_per_prompt) when
    #: decorated with ``titan_rl.rollout.hooks.per_group``; e.g. a multi-turn rollout with
    #: tools (titan_rl.rollout.multiturn). None: the built-in single-turn rollout.
    generate_fn: str | None = None
    #: partial rollouts: once a step has its groups, generations still running are aborted,
    #: kept with the tokens they have, and continued on the newer weights by the next step's
    #: rollout (each token records the weight version that produced it, and the rollout
    #: correction uses that version's logprobs). Needs over_sample_factor > 1 (the extra
    #: prompts are what a step does not wait for) and the built-in rollout (no generate_fn).
    partial: bool = False

    @field_validator("generate_fn")
    @classmethod
    def _check_generate_fn(cls, v: str | None) -> str | None:
        if v is not None:  # its form; importing it is preflight's (check_generate_fn)
            split_spec(v, "rollout.generate_fn", "my_pkg.agent:generate")
        return v

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        in_flight = int(self.prompts_per_step * self.over_sample_factor)
        if self.partial and in_flight <= self.prompts_per_step:
            raise ValueError(
                f"rollout.partial=true needs more prompts in flight ({in_flight}: "
                "prompts_per_step x over_sample_factor) than a step takes "
                f"({self.prompts_per_step}): raise rollout.over_sample_factor (e.g. 1.5); a "
                "step takes the first groups to finish and carries the others"
            )
        if self.partial and self.generate_fn:
            raise ValueError(
                "rollout.partial=true continues the built-in single-turn rollout; a "
                f"rollout.generate_fn hook ({self.generate_fn}) owns its generation: set one"
            )
        if self.top_k == 0 or self.top_k < -1:  # the engines' rule (SGLang's and the built-in)
            raise ValueError(
                f"rollout.top_k={self.top_k}: use -1 (the whole vocabulary) or at least 1"
            )
        return self


class EnginesConfig(Section):
    """Rollout engines: built-in on CPU, SGLang on GPUs. Resolved once, in the placement plan
    (titan_rl/placement.py), into the launch each engine actor runs."""

    #: "auto": the built-in engine on a cpu accelerator, SGLang on cuda / musa.
    backend: Literal["auto", "sglang", "builtin"] = "auto"
    #: engine servers (several need ``router: true``).
    num_engines: PositiveInt = 1
    #: devices per engine (SGLang's --tp-size; the built-in engine: 1).
    tp_size: PositiveInt = 1
    #: SGLang's --mem-fraction-static (None: SGLang's default).
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    #: colocated: trainer and engines share devices (engines release memory while training).
    colocate: bool = False
    #: sglang-router in front of the engines: one URL spreading the requests.
    router: bool = False
    #: built-in engine: torch (OpenMP) threads per engine, shared by its TP ranks. None:
    #: ``OMP_NUM_THREADS`` where set, else auto: the cores this job may use
    #: (``os.sched_getaffinity``), all of them when colocated (generation and training take
    #: turns), else split with the trainer processes (``trainer_threads``); see --dry-run.
    num_threads: PositiveInt | None = None
    #: the engines' weights and compute (``--dtype``); "auto": the checkpoint's (fp32, as the
    #: trainer writes it). bfloat16 makes the rollout's numerics differ from an fp32
    #: trainer's, as GPU engines do.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: prompt tokens an engine prefills per scheduling step, between its running requests'
    #: decode steps (``--chunked-prefill-size``, both backends): a longer prompt goes in
    #: chunks, so other requests wait for a chunk, not for all of it. -1: whole prompts;
    #: None: the engine's default (the built-in engine's 2048, SGLang's own).
    chunked_prefill_size: int | None = None
    #: the engines (and router) require ``Authorization: Bearer <api_key>``; None: open.
    api_key: str | None = None
    #: how long requests to engines that do not answer (connection refused or reset, 5xx)
    #: are sent again, from the first failure, and how long a restarted engine may take to
    #: serve the current weights: it must cover a restart (the built-in engine: ~20 s on 2
    #: busy cores; SGLang loading a large model: minutes).
    retry_timeout_s: float = Field(900.0, gt=0)
    #: an engine that has not answered its health probe (``GET /health``) for this long is
    #: hung (stopped, deadlocked): its supervisor kills it (SIGKILL) and restarts it as a dead
    #: one, and it gets the current weights before it serves; silences are logged from 5 s on.
    health_timeout_s: float = Field(60.0, gt=0)

    @field_validator("chunked_prefill_size")
    @classmethod
    def _check_chunked_prefill_size(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError(f"{v}: give a positive number of tokens, or -1 (whole prompts)")
        return v


class RLDataConfig(TokenizerFields, ArithmeticFields):
    """The prompts: the tokenizer and arithmetic keys are pretraining's (titan_core's
    ``data`` section), the rest RL's own."""

    #: arithmetic: generated a+b= problems (exact-match reward); jsonl / parquet: a file
    #: with ``prompt_key`` and ``label_key`` columns.
    type: Literal["arithmetic", "jsonl", "parquet"] = "arithmetic"
    #: jsonl / parquet: the training prompts.
    path: str | None = None
    #: jsonl / parquet: held-out prompts (None: ``num_eval`` rows held out of ``path``).
    eval_path: str | None = None
    #: the prompt's column.
    prompt_key: str = "prompt"
    #: the label's column (what the reward compares with).
    label_key: str = "label"
    #: wrap each prompt in the tokenizer's chat template (needs tokenizer_type hf).
    apply_chat_template: bool = False
    #: held-out prompts per evaluation.
    num_eval: PositiveInt = 500

    @model_validator(mode="after")
    def _check(self) -> RLDataConfig:
        if self.type != "arithmetic" and not self.path:
            raise ValueError(f"data.path is required for data.type={self.type}")
        return self


class RLRunConfig(Section):
    #: the run's folder: checkpoints, metrics.jsonl, reward.png, logs (one job at a time).
    dir: str = "runs/grpo"
    #: RL steps (rollout, train, sync) of the run.
    num_steps: PositiveInt = 200
    #: evaluate held-out accuracy before the first step, every N steps and at the last;
    #: null: no evaluation at all (slime's ``--eval-interval`` unset).
    eval_interval: PositiveInt | None = 20
    #: save a checkpoint every N steps and at the last; 0: only at the last; null: none at
    #: all (slime's ``--save-interval`` unset; ``save_on_signal`` still saves on a signal).
    save_interval: int | None = Field(100, ge=0)
    #: on SIGTERM / SIGINT, save the last completed step before exiting 143 / 130 (as
    #: Megatron-LM's --exit-signal-handler does); false: exit without saving.
    save_on_signal: bool = True
    #: the prompts' order (and the arithmetic problems').
    seed: int = 1
    #: print a status line every N steps.
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
    #: where the policy starts.
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    #: the policy's architecture (pretraining's ``model`` section; must match the base).
    model: ModelConfig = Field(default_factory=ModelConfig)
    #: the trainer's layout (pretraining's ``parallel`` section).
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    #: the optimizer (pretraining's ``train`` section; the batch is the rollout's).
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
    #: torch (OpenMP) threads of each trainer process. None: ``OMP_NUM_THREADS`` where set,
    #: else auto: the cores this job may use (``os.sched_getaffinity``) shared by the
    #: trainer processes, and, unless the engines are colocated (taking turns with the
    #: trainer), by the engines' TP ranks too (``engines.num_threads``), at least 1 each;
    #: ``--dry-run`` prints both.
    trainer_threads: PositiveInt | None = None
    #: sampling the responses.
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    #: the rollout engines.
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    #: trainer -> engines weight transfer after each step.
    sync: SyncConfig = Field(default_factory=SyncConfig)
    #: advantage estimator and policy loss.
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    #: how a response is scored.
    reward: RewardConfig = Field(default_factory=RewardConfig)
    #: the prompts.
    data: RLDataConfig = Field(default_factory=RLDataConfig)
    #: the run's folder, length and intervals.
    run: RLRunConfig = Field(default_factory=RLRunConfig)
    #: the Ray cluster.
    ray: RayConfig = Field(default_factory=RayConfig)
    #: profiler traces of these RL steps, one file per trainer rank (``<run.dir>/traces``):
    #: ProfilerStep#N with titan/rl/{rollout,train,sync} and microbatch ranges inside.
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if self.parallel.p2p_transport != "torch":
            raise ValueError(
                f"parallel.p2p_transport={self.parallel.p2p_transport} is pretraining's "
                "(titan_core.pretrain); the GRPO trainer's pipeline runs over torch: unset it"
            )
        batch = self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt
        if batch % self.train.micro_batch_size:
            raise ValueError(
                f"rollout.prompts_per_step x n_samples_per_prompt ({batch}) must be divisible by "
                f"train.micro_batch_size ({self.train.micro_batch_size})"
            )
        problem = group_size_problem(
            self.algo.advantage_estimator, self.rollout.n_samples_per_prompt
        )
        if problem:
            raise ValueError(problem)
        if self.engines.num_engines > 1 and not self.engines.router:
            raise ValueError(
                f"engines.num_engines={self.engines.num_engines} needs engines.router=true: the "
                "rollout sends every request to one URL, the router's, which spreads them"
            )
        if self.algo.entropy_coef and self.parallel.tensor_model_parallel_size > 1:
            raise ValueError(
                "algo.entropy_coef > 0 needs parallel.tensor_model_parallel_size=1 (the entropy "
                "is computed on full-vocabulary logits); set algo.entropy_coef=0 or TP 1"
            )
        agents = self.sync.mooncake.agents
        if self.sync.transport == "mooncake" and len(agents) != self.engines.num_engines:
            raise ValueError(
                f"sync.mooncake.agents has {len(agents)} URLs for engines.num_engines="
                f"{self.engines.num_engines}; give one agent per engine, in the engines' order"
            )
        return self

    def pretrain_view(self, world_size: int) -> PretrainConfig:
        """The titan_core config the Megatron trainer of ``world_size`` processes is built
        from (same base as pretraining; the global batch is the rollout's), its layout checked
        against ``world_size``: a ConfigError naming the key, before any process group."""
        r = self.rollout
        batch = r.prompts_per_step * r.n_samples_per_prompt
        try:
            view = PretrainConfig(
                model=self.model,
                parallel=self.parallel,
                train=self.train.model_copy(update={"global_batch_size": batch}),
                data={"tokenizer_type": self.data.tokenizer_type,
                      "tokenizer_model": self.data.tokenizer_model},
                run={"dir": self.run.dir},
            )  # fmt: skip
        except ValidationError as e:  # layers / heads / experts against the layout
            raise ConfigError(
                "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
            ) from None
        p = self.parallel
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        model_parallel *= p.context_parallel_size
        mbs = self.train.micro_batch_size
        if world_size % model_parallel == 0 and batch % (mbs * (world_size // model_parallel)):
            dp = world_size // model_parallel  # check_layout's, in the rollout's keys
            raise ConfigError(
                f"rollout.prompts_per_step x n_samples_per_prompt ({batch}) must be divisible "
                f"by train.micro_batch_size x data-parallel size ({mbs} x {dp}, from "
                f"trainer_processes={world_size})"
            )
        try:
            check_layout(view, world_size)
        except ConfigError as e:
            raise ConfigError(f"trainer_processes={world_size}: {e}") from None
        return view
