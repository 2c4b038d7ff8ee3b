"""Typed configs of the rollout engines and the router, and the frozen launch spec an engine
actor takes as is.

An :class:`EngineServerConfig` is a server as one asks for it (``backend: auto`` allowed);
an :class:`EngineLaunch` is that server resolved for a machine: the backend chosen, the
device named, the rules checked. The GRPO job resolves its engines once, in the placement
plan (titan_rl/placement.py); a server started by hand resolves in :meth:`~EngineServerConfig.
launch`. Either way the actor receives the launch and turns it into argv in one function
(titan_rl/actors/server.py's ``build_command``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import ConfigDict, Field, field_validator, model_validator

from titan_core.config import Section
from titan_rl.engine_settings import DEFAULTS, Dtype, check_chunked_prefill_size, engine_problem
from titan_rl.nodes import RayNode

EngineBackend = Literal["builtin", "sglang"]


def resolve_backend(requested: str, accelerator: str) -> EngineBackend:
    """``auto``: the built-in engine on a cpu accelerator, SGLang on cuda / musa. The one place
    ``auto`` is resolved (the placement plan and a hand-started server both call it)."""
    if requested == "auto":
        return "builtin" if accelerator == "cpu" else "sglang"
    return cast(EngineBackend, requested)


def _check(backend: str, tp_size: int, device: str | None) -> None:
    problem = engine_problem(backend, tp_size, device)
    if problem is not None:
        key, why = problem
        value = tp_size if key == "tp_size" else backend
        raise ValueError(f"{key}={value}: {why}")


class EngineServerConfig(Section):
    """One rollout server as asked for: SGLang on cuda/musa, the built-in engine on cpu. The
    settings the built-in engine shares (``dtype``, ``tp_size``, ``num_threads``, ...) default
    to its own (titan_rl/engine_settings.py) and reach it as its flags of the same names."""

    model_path: str
    #: "auto": the built-in engine when the accelerator is cpu, SGLang otherwise.
    backend: Literal["auto", "sglang", "builtin"] = "auto"
    tp_size: int = Field(DEFAULTS.tp_size, ge=1)
    base_gpu_id: int = Field(0, ge=0)
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    enable_memory_saver: bool = False
    host: str = "127.0.0.1"
    #: None: pick a free port at start-up (on the node the server runs on).
    port: int | None = Field(None, ge=1, le=65535)
    api_key: str | None = None
    weight_version: str = DEFAULTS.weight_version
    skip_tokenizer_init: bool = False
    context_length: int | None = Field(DEFAULTS.context_length, ge=1)
    #: built-in engine only: torch threads (None: torch's default).
    num_threads: int | None = Field(DEFAULTS.num_threads, ge=1)
    #: weights and compute dtype (``--dtype``, both backends); "auto": the checkpoint's.
    dtype: Dtype = DEFAULTS.dtype
    #: SGLang's ``--enable-return-routed-experts`` (requests may ask for routed experts;
    #: the built-in engine serves them on MoE models without it).
    enable_return_routed_experts: bool = False
    #: ``--chunked-prefill-size`` (both backends): prompt tokens prefilled per scheduling
    #: step; -1: whole prompts; None: the engine's default.
    chunked_prefill_size: int | None = DEFAULTS.chunked_prefill_size
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = Field(900.0, gt=0)
    restart_on_failure: bool = True
    max_restarts: int = Field(3, ge=0)
    #: a running server that has not answered ``GET /health`` (any status) for this long is
    #: hung: its supervisor SIGKILLs its process group and restarts it as a dead one
    health_timeout_s: float = Field(60.0, gt=0)
    log_dir: str | None = None

    _check_chunk = field_validator("chunked_prefill_size")(check_chunked_prefill_size)

    @model_validator(mode="after")
    def _check_backend(self) -> EngineServerConfig:
        if self.backend != "auto":  # auto is checked once resolved, in EngineLaunch
            _check(self.backend, self.tp_size, None)
        return self

    def launch(self, accelerator: str | None = None, **resolved: Any) -> EngineLaunch:
        """This server resolved for ``accelerator`` (None: this machine's), with ``resolved``
        settings (``base_gpu_id``, ``bind_node_ip``, ...) on top; ValueError if it cannot run."""
        if accelerator is None:
            from titan_core.accelerator import get_accelerator

            accelerator = get_accelerator().name
        fields = self.model_dump(exclude={"backend"}) | resolved
        return EngineLaunch(
            **fields, backend=resolve_backend(self.backend, accelerator), device=accelerator
        )


class MooncakeAgentLaunch(Section):
    """A Mooncake agent (titan_rl/sync/mooncake_agent.py) an engine's actor starts beside its
    engine, on the engine's host (``sync.transport=mooncake`` without ``sync.mooncake.agents``,
    in the GRPO job): its receive buffer and TransferEngine settings (frozen)."""

    model_config = ConfigDict(frozen=True)

    #: the receive buffer, one region per trainer sender rank (``--buffer-bytes``)
    buffer_bytes: int = Field(gt=0)
    #: the TransferEngine's protocol (``sync.mooncake.protocol``)
    protocol: Literal["tcp", "rdma"] = "tcp"
    #: the RDMA device ("": Mooncake's choice; ``sync.mooncake.device``)
    device: str = ""


class EngineLaunch(EngineServerConfig):
    """One engine server, resolved: what its actor runs, as is (frozen)."""

    model_config = ConfigDict(frozen=True)

    backend: EngineBackend  # type: ignore[assignment]
    #: the accelerator it serves on ("cpu", "cuda", "musa"): SGLang's ``--device``.
    device: str
    #: bind to the IP of the node Ray places the actor on (known only there): the driver of
    #: a job on an existing cluster may run on another node.
    bind_node_ip: bool = False
    #: a Mooncake agent the actor starts beside the engine once it answers (None: none)
    mooncake_agent: MooncakeAgentLaunch | None = None

    @model_validator(mode="after")
    def _check_backend(self) -> EngineLaunch:  # in place of EngineServerConfig's
        _check(self.backend, self.tp_size, self.device)
        return self

    def launch(self, accelerator: str | None = None, **resolved: Any) -> EngineLaunch:
        """Already resolved: itself, with ``resolved`` settings on top."""
        return self.model_copy(update=resolved) if resolved else self


@dataclass(frozen=True)
class PlacedEngine:
    """An engine's launch and where its actor goes (Ray ``.options()``; None: it floats)."""

    launch: EngineLaunch
    actor_options: dict[str, Any] | None = None
    #: the Ray node it is placed on (None: not known, a floating actor)
    node: RayNode | None = None


class RouterConfig(Section):
    """sglang-router in front of the engines; engines are registered with ``POST /workers``."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535)
    policy: Literal["cache_aware", "random", "round_robin", "power_of_two"] = "cache_aware"
    health_check_interval_secs: int = Field(5, ge=1)
    health_failure_threshold: int = Field(2, ge=1)
    retry_max_retries: int = Field(5, ge=0)
    request_timeout_secs: int = Field(3600, ge=1)
    extra_args: list[str] = Field(default_factory=list)
    startup_timeout_s: float = Field(60.0, gt=0)
    log_dir: str | None = None


class RolloutEnginesConfig(Section):
    """An engine group as asked for: ``num_engines`` servers behind one router (what tests
    and the slime / miles adapters start; the GRPO job's comes from its placement plan)."""

    num_engines: int = Field(1, ge=1)
    server: EngineServerConfig
    router: RouterConfig = Field(default_factory=RouterConfig)

    @model_validator(mode="after")
    def _check(self) -> RolloutEnginesConfig:
        if self.server.port is not None and self.num_engines > 1:
            raise ValueError("server.port is fixed but num_engines > 1; leave server.port unset")
        if self.num_engines > 1 and not self.router.enabled:
            raise ValueError("num_engines > 1 needs router.enabled: true (one URL for the client)")
        return self
