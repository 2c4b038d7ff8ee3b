"""The GRPO config: policy (Megatron sections shared with pretraining), rollout, algorithm,
reward, sync, data and run. Unknown keys and bad values are errors naming the key; a key
that moved (pretraining's ``train.seed`` under GRPO, the old top-level ``ppo_steps``) is an
error naming the key to use.

What GRPO shares with pretraining is declared once, in titan_core: ``model``, ``parallel``
and the ``train`` keys of :class:`~titan_core.config.pretrain.TrainFields` (micro batch,
optimizer, LR schedule, precision, FP8, offload, recompute). What each owns is declared by
it: GRPO's batch is the rollout's (``rollout.*``), its length, seed, logging and evaluation
are ``run.*``, its policy-update passes ``train.ppo_steps``, its trainer processes
``trainer.*``. :meth:`GRPOConfig.pretrain_view` derives pretraining's full ``train`` section
from them for the Megatron trainer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from titan_core.config import ConfigError, Section
from titan_core.config.pretrain import (
    ArithmeticFields,
    LrDecayStyle,
    ModelConfig,
    ParallelConfig,
    PretrainConfig,
    ProfileConfig,
    TokenizerFields,
    TrainConfig,
    TrainFields,
    check_layout,
)
from titan_rl.algo.config import AlgoConfig
from titan_rl.algo.estimators import group_size_problem
from titan_rl.engine_settings import DEFAULTS as ENGINE_DEFAULTS
from titan_rl.engine_settings import Dtype, check_chunked_prefill_size
from titan_rl.rewards.config import RewardConfig
from titan_rl.rollout.engine_clients import DEFAULT_CLIENT, client_problem
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
    #: "auto": the group requests a rollout sends at once go to the engine as one batched
    #: ``/generate`` request (each group's samples as its own request gives them), on one
    #: built-in engine without over-sampling or partial rollouts, and with max_concurrency
    #: at least prompts_per_step; elsewhere (a router, SGLang, over-sampling) one request
    #: per group, with a line at start saying why.
    #: "off": one request per group everywhere.
    coalesce: Literal["auto", "off"] = "auto"

    @field_validator("coalesce", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        return "off" if v is False else v  # YAML reads a bare off as false

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
    #: the client the driver and the trainers talk to the engines with (generation, weight
    #: sync, memory, versions): "sglang" (SGLang's HTTP API, which the built-in engine and
    #: the router speak too), a name registered in titan_rl/rollout/engine_clients.py
    #: (``register_engine_client``, or an installed package's entry point), or
    #: "module.path:function" of a factory ``(url, ClientOptions) -> EngineClient``.
    client: str = DEFAULT_CLIENT
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
    #: turns), else split with the trainer processes (``trainer.num_threads``); see --dry-run.
    num_threads: PositiveInt | None = None
    #: the engines' weights and compute (``--dtype``); "auto": the checkpoint's (fp32, as the
    #: trainer writes it). bfloat16 makes the rollout's numerics differ from an fp32
    #: trainer's, as GPU engines do.
    dtype: Dtype = ENGINE_DEFAULTS.dtype
    #: prompt tokens an engine prefills per scheduling step, between its running requests'
    #: decode steps (``--chunked-prefill-size``, both backends): a longer prompt goes in
    #: chunks, so other requests wait for a chunk, not for all of it. -1: whole prompts;
    #: None: the engine's default (the built-in engine's 2048, SGLang's own).
    chunked_prefill_size: int | None = ENGINE_DEFAULTS.chunked_prefill_size
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

    _check_chunk = field_validator("chunked_prefill_size")(check_chunked_prefill_size)

    @field_validator("client")
    @classmethod
    def _check_client(cls, v: str) -> str:
        problem = client_problem(v)  # its form; importing a path is preflight's
        if problem:
            raise ValueError(problem)
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


#: pretraining's ``train`` keys that GRPO owns elsewhere (or has no use for): what to use instead
MOVED_TRAIN_KEYS: dict[str, str] = {
    "seed": "use run.seed (one seed: the prompts' order and the trainer's random state)",
    "log_interval": "use run.log_interval",
    "eval_interval": "use run.eval_interval (held-out accuracy every N RL steps)",
    "eval_iters": "use data.num_eval (the held-out prompts of each evaluation)",
    "train_iters": (
        "use run.num_steps (the LR schedule's horizon is run.num_steps x train.ppo_steps "
        "optimizer steps; train.lr_decay_iters sets another)"
    ),
    "global_batch_size": (
        "an optimizer step takes the whole rollout batch: set rollout.prompts_per_step x "
        "rollout.n_samples_per_prompt"
    ),
    "stop_at_eval_accuracy": "GRPO runs run.num_steps steps: drop it",
}
#: top-level keys that moved into a section: the key to use
MOVED_TOP_KEYS: dict[str, str] = {
    "ppo_steps": "use train.ppo_steps",
    "trainer_processes": "use trainer.num_processes",
    "trainer_threads": "use trainer.num_threads",
}


def _refuse_moved(data: Any, moved: dict[str, str], prefix: str) -> Any:
    """A config naming a key of ``moved``: an error naming it and what to use instead."""
    if isinstance(data, dict):
        found = [k for k in moved if k in data]
        if found:
            raise ValueError(
                "; ".join(f"{prefix}{k} is not a titan_rl.grpo key: {moved[k]}" for k in found)
            )
    return data


class RLTrainConfig(TrainFields):
    """GRPO's ``train`` section: the policy update. The keys shared with pretraining
    (:class:`~titan_core.config.pretrain.TrainFields`, Megatron's names: ``lr_warmup_iters``
    and ``lr_decay_iters`` count optimizer steps) plus RL's own; the batch is the rollout's,
    the length ``run.num_steps``, the seed ``run.seed``."""

    #: policy-update passes over each rollout batch, one optimizer step each (PPO epochs:
    #: verl's ``ppo_epochs``); the LR schedule's horizon is run.num_steps x this.
    ppo_steps: PositiveInt = 1
    # RL's defaults where pretraining's differ (a section that sets some keys gets these
    # for the rest, as one that sets none does): a small constant LR, no warmup, no decay.
    #: samples per forward/backward of the update (the rollout batch is split into these).
    micro_batch_size: PositiveInt = 64
    #: the policy's learning rate.
    lr: float = Field(1e-4, gt=0)
    #: optimizer steps of linear warmup.
    lr_warmup_iters: int = Field(0, ge=0)
    #: the LR schedule over run.num_steps x ppo_steps optimizer steps.
    lr_decay_style: LrDecayStyle = "constant"
    #: AdamW's decoupled weight decay.
    weight_decay: float = Field(0.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _refuse_pretraining_keys(cls, data: Any) -> Any:
        return _refuse_moved(data, MOVED_TRAIN_KEYS, "train.")


class TrainerConfig(Section):
    """The Megatron trainer's processes (the engines' counterpart, ``engines.*``); placed by
    titan_rl/placement.py."""

    #: Megatron trainer processes (TP x PP x CP x DP); each is a Ray actor.
    num_processes: PositiveInt = 1
    #: torch (OpenMP) threads of each trainer process. None: ``OMP_NUM_THREADS`` where set,
    #: else auto: the cores this job may use (``os.sched_getaffinity``) shared by the
    #: trainer processes, and, under ``rollout.async`` with engines beside it (computing at
    #: once), by the engines' TP ranks too (``engines.num_threads``), at least 1 each;
    #: ``--dry-run`` prints both.
    num_threads: PositiveInt | None = None


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
    #: Megatron-LM's --exit-signal-handler does), and before exiting 1 when the engines are
    #: lost for good (their node lost, their supervisor given up); false: exit without saving.
    save_on_signal: bool = True
    #: the prompts' order (and the arithmetic problems'), the engines' sampling seeds and the
    #: trainer's random state (Megatron's ``--seed``).
    seed: int = 1
    #: print a status line every N steps.
    log_interval: PositiveInt = 1


#: the resources a placement bundle asks for itself (titan_rl/placement.py)
RAY_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RayConfig(Section):
    #: None: a local Ray started for this run (RAY_ADDRESS is not consulted); else an existing
    #: cluster's address ("auto", "host:6379", "ray://host:10001"), whose resources are its own.
    address: str | None = None
    #: local Ray only: logical CPUs (None: max(2, cpu count, the placement's CPU bundles)).
    num_cpus: PositiveInt | None = None
    #: Ray namespace of the job's actors (None: Ray's anonymous one).
    namespace: str | None = None
    #: cluster only: custom Ray resources each trainer process's bundle asks for besides its
    #: CPU / device, which puts the trainers on the nodes that declare them (``ray start
    #: --resources '{"trainer_node": 8}'``, or Ray's own ``node:<ip>``), as verl's resource
    #: pools and slime's ``--actor-num-nodes`` do; {}: wherever Ray packs them.
    trainer_resources: dict[str, PositiveFloat] = Field(default_factory=dict)
    #: cluster only: the same for each engine's bundles (disaggregated engines: colocated
    #: ones share the trainer's bundles).
    engine_resources: dict[str, PositiveFloat] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> RayConfig:
        if self.address is not None and self.num_cpus is not None:
            raise ValueError(
                "ray.num_cpus applies to a local Ray only; an existing cluster (ray.address) "
                "brings its own resources, so unset ray.num_cpus"
            )
        for key in ("trainer_resources", "engine_resources"):
            asked = getattr(self, key)
            if asked and self.address is None:
                raise ValueError(
                    f"ray.{key} places actors on the cluster nodes that declare those "
                    "resources; a local Ray is this one machine: set ray.address to the "
                    f"cluster's, or drop ray.{key}"
                )
            for name in asked:
                if name in RAY_OWN_RESOURCES:
                    raise ValueError(
                        f"ray.{key}.{name}: the placement asks for {name} itself (a CPU, and a "
                        "device on GPU machines); name a custom resource that labels the "
                        "nodes (ray start --resources) or node:<ip>"
                    )
        return self


class GRPOConfig(Section):
    #: where the policy starts.
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    #: the policy's architecture (pretraining's ``model`` section; must match the base).
    model: ModelConfig = Field(default_factory=ModelConfig)
    #: the trainer's layout (pretraining's ``parallel`` section).
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    #: the policy update: optimizer, LR schedule, precision (pretraining's shared ``train``
    #: keys) and ``ppo_steps``; the batch is the rollout's.
    train: RLTrainConfig = Field(default_factory=RLTrainConfig)
    #: the Megatron trainer's processes and threads.
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
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

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, data: Any) -> Any:
        return _refuse_moved(data, MOVED_TOP_KEYS, "")

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (``run.num_steps`` x ``train.ppo_steps``): the LR
        schedule's horizon, pretraining's ``train.train_iters``."""
        return self.run.num_steps * self.train.ppo_steps

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        decay = self.train.lr_decay_iters or self.optimizer_steps
        if self.train.lr_warmup_iters >= decay:
            raise ValueError(
                f"train.lr_warmup_iters ({self.train.lr_warmup_iters}) must be below the decay "
                f"length in optimizer steps (train.lr_decay_iters, else run.num_steps x "
                f"train.ppo_steps = {decay}); lower train.lr_warmup_iters"
            )
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
        problem = self.sync.settings.engines_problem(
            self.engines.num_engines, "engines.num_engines"
        )
        if problem:
            raise ValueError(problem)
        return self

    def pretrain_view(self, world_size: int) -> PretrainConfig:
        """The titan_core config the Megatron trainer of ``world_size`` processes is built
        from (same base as pretraining), its layout checked against ``world_size``: a
        ConfigError naming the key, before any process group. Pretraining's own ``train``
        keys come from GRPO's: the global batch is the rollout's, ``train_iters`` (the LR
        schedule's horizon) :attr:`optimizer_steps`, the seed ``run.seed``."""
        r = self.rollout
        batch = r.prompts_per_step * r.n_samples_per_prompt
        shared = self.train.model_dump(include=set(TrainFields.model_fields))
        try:
            train = TrainConfig(
                **shared, global_batch_size=batch, train_iters=self.optimizer_steps,
                seed=self.run.seed,
            )  # fmt: skip
            view = PretrainConfig(
                model=self.model,
                parallel=self.parallel,
                train=train,
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
                f"trainer.num_processes={world_size})"
            )
        try:
            check_layout(view, world_size)
        except ConfigError as e:
            raise ConfigError(f"trainer.num_processes={world_size}: {e}") from None
        return view
