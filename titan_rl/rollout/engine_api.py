"""The rollout-engine seam: what Titan calls on an engine client, whatever API the engine speaks.

The GRPO loop, the rollout (``titan_rl.rollout.generate``), the weight sync
(``titan_rl.sync``), its parity probe and the engine recovery (``titan_rl.actors.recovery``)
hold an :class:`EngineClient` and call nothing else on it. SGLang's HTTP API (SGLang, its
router, Titan's built-in engine) is the ``sglang`` client, ``SGLangClient``; an engine that
speaks another API is one module with a class that has these methods, made by a factory that
``engines.client`` names (``titan_rl.rollout.engine_clients``, see there).

A client raises :class:`EngineUnavailableError` when its engine cannot be reached (the sync
then counts a supervised engine as lost, not failed) and :class:`EngineError` for anything
else the engine refuses.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


class EngineError(RuntimeError):
    """An engine refused a call or answered something the client cannot use."""


class EngineUnavailableError(EngineError):
    """The engine could not be reached, or kept failing, within the client's retries."""


@dataclass
class RetryPolicy:
    """Retries of connection errors and 5xx answers for ``timeout_s`` from the first failure
    (the last one at the deadline), and at most ``max_retries`` extra attempts when set.

    The window, not a count, is what must cover a server's restart: with the backoff growing
    to ``max_backoff_s``, five retries are over in ~3 s, long before a restarted engine
    answers (~20 s for the built-in engine on 2 busy cores, minutes for SGLang loading a
    large model). The backoff stops growing at 1 s: a request waiting out a restart is sent
    again within a second of the engine serving (at 5 s its rollout idled up to 5 s more),
    and a retry that finds the port closed costs the engine nothing.
    """

    timeout_s: float = 60.0
    max_retries: int | None = None
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.timeout_s < 0:
            raise ValueError(f"RetryPolicy.timeout_s must be >= 0, got {self.timeout_s}")
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError(f"RetryPolicy.max_retries must be >= 0, got {self.max_retries}")

    def delay(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt)
        return base * (1.0 + random.uniform(-self.jitter, self.jitter))


@dataclass(frozen=True)
class ClientOptions:
    """How a client talks to its engine (every client's factory takes these)."""

    api_key: str | None = None
    #: generation requests in flight at once
    max_concurrency: int = 256
    #: timeout of a control call (weights, pause, memory), seconds
    control_timeout_s: float = 600.0
    #: None: the client's default
    retry: RetryPolicy | None = None


@dataclass
class GenerateOutput:
    """One completion: the fields an RL loop reads from an engine's answer."""

    output_ids: list[int]
    finish_reason: dict[str, Any]
    weight_version: str | None
    prompt_tokens: int
    completion_tokens: int
    rid: str | None
    output_logprobs: list[float] | None = None
    text: str | None = None
    #: logprob of each prompt token from ``logprob_start_len`` on (the first is None: it has
    #: no context); None unless asked for
    input_logprobs: list[float | None] | None = None
    #: the engine's own answer metadata, as it sent it
    meta_info: dict[str, Any] = field(default_factory=dict)
    #: the ``routed_experts_start_len`` the request was sent with (the first token whose
    #: experts ``meta_info["routed_experts"]`` holds)
    routed_experts_start_len: int = 0

    def routed_experts(self, num_layers: int) -> np.ndarray | None:
        """The experts each token was routed to, ``[tokens, num_layers, top_k]`` int32, from
        SGLang's ``meta_info["routed_experts"]`` (base64 int32, C order); tokens are
        ``[routed_experts_start_len, prompt_tokens + completion_tokens - 1)`` (the last
        sampled token is never fed). None when the answer holds none; EngineError when its
        size does not fit that many tokens and ``num_layers``."""
        data = self.meta_info.get("routed_experts")
        if data is None:
            return None
        rows = max(
            self.prompt_tokens + self.completion_tokens - 1 - self.routed_experts_start_len, 0
        )
        flat = np.frombuffer(base64.b64decode(data), dtype="<i4").astype(np.int32)
        if rows == 0 and flat.size == 0:
            return flat.reshape(0, num_layers, 0)
        if rows == 0 or flat.size % (rows * num_layers):
            raise EngineError(
                f"routed_experts holds {flat.size} values, which is not {rows} tokens x "
                f"{num_layers} layers x top_k; check the model's layer count"
            )
        return flat.reshape(rows, num_layers, -1)

    @property
    def finish_type(self) -> str:
        return str((self.finish_reason or {}).get("type", ""))

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"


@runtime_checkable
class EngineClient(Protocol):
    """One engine (or a router in front of several) as Titan uses it: the calls and the
    arguments Titan passes, named as in SGLang's native API; every method is a coroutine. A
    client may accept more (SGLangClient does)."""

    #: the engine's address, as errors and logs name it
    base_url: str

    async def aclose(self) -> None: ...

    # ---- state ---------------------------------------------------------------------------
    async def get_model_info(self) -> dict[str, Any]:
        """At least ``model_path`` (what the engine loaded) and ``weight_version``."""
        ...

    async def weight_version(self) -> str | None:
        """The version the engine serves now, in one attempt; None when it does not answer."""
        ...

    # ---- generation ----------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = False,
        **extra: Any,
    ) -> GenerateOutput | list[GenerateOutput]:
        """One prompt's completion; a list of ``sampling_params['n']`` when n > 1."""
        ...

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling_params: dict[str, Any], **extra: Any
    ) -> list[GenerateOutput]:
        """Several prompts in one request; outputs prompt-major. The parity probe passes
        ``return_logprob=True, logprob_start_len=0``: every input token's logprob."""
        ...

    async def abort_request(
        self, rid: str = "", abort_all: bool = False, *, retries: int | None = None
    ) -> None: ...

    # ---- flow control and memory (weight sync, colocation) -------------------------------
    async def pause_generation(self, mode: str = "abort") -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> bool:
        """True if flushed; False if the engine refused (requests running)."""
        ...

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    # ---- weights (one method per transport; a client without one raises EngineError) ----
    async def update_weights_from_disk(
        self, model_path: str, *, flush_cache: bool = True
    ) -> dict[str, Any]: ...

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]: ...

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        """Join the trainer's broadcast group (the trainer is rank 0; never retried)."""
        ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str,
        load_format: str | None,
        flush_cache: bool,
    ) -> dict[str, Any]:
        """Receive one broadcast of the named tensors from the trainer (never retried)."""
        ...

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]: ...

    async def update_weight_version(self, new_version: str) -> dict[str, Any]: ...
