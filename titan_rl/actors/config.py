"""Typed configs of the rollout engines and the router (YAML section ``rollout``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from titan_core.config import Section


class EngineServerConfig(Section):
    """One rollout server: SGLang on cuda/musa, the built-in engine on cpu."""

    model_path: str
    #: "auto": the built-in engine when the accelerator is cpu, SGLang otherwise.
    backend: Literal["auto", "sglang", "builtin"] = "auto"
    tp_size: int = Field(1, ge=1)
    base_gpu_id: int = Field(0, ge=0)
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    enable_memory_saver: bool = False
    host: str = "127.0.0.1"
    #: None: pick a free port at start-up.
    port: int | None = Field(None, ge=1, le=65535)
    api_key: str | None = None
    weight_version: str = "default"
    skip_tokenizer_init: bool = False
    context_length: int | None = Field(None, ge=1)
    #: built-in engine only: torch threads (None: torch's default).
    num_threads: int | None = Field(None, ge=1)
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = Field(900.0, gt=0)
    restart_on_failure: bool = True
    max_restarts: int = Field(3, ge=0)
    log_dir: str | None = None

    @model_validator(mode="after")
    def _check(self) -> EngineServerConfig:
        if self.backend == "builtin" and self.tp_size != 1:
            raise ValueError("backend 'builtin' (the CPU engine) runs with tp_size 1")
        return self


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
    """The engine group: ``num_engines`` servers behind one router."""

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
