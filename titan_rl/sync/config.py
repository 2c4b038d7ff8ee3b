"""The ``sync`` section: how trainer weights reach the rollout engines.

``sync.transport`` picks the transport; its settings are the section of the same name
(``sync.tensor``, ``sync.disk``, ``sync.distributed``, ``sync.mooncake``: one per transport of
the table in :mod:`titan_rl.sync.transports`, each declared in its transport's module), and
only that section may be set. The keys outside them apply to every transport.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, create_model, model_validator

from titan_core.config.loader import Section
from titan_rl.sync.transports import TRANSPORTS, TransportName, TransportSection

#: the flat keys of earlier versions -> their key now (an error names the new one)
MOVED_KEYS = {
    "tensor_format": "tensor.format",
    "disk_dir": "disk.dir",
    "disk_keep": "disk.keep",
    "master_address": "distributed.master_address",
    "master_port": "distributed.master_port",
    "group_name": "distributed.group_name",
    "backend": "distributed.backend",
    "mooncake_agents": "mooncake.agents",
    "mooncake_protocol": "mooncake.protocol",
    "mooncake_device": "mooncake.device",
    "mooncake_host": "mooncake.host",
}


class SyncKeys(Section):
    """The keys of ``sync`` that every transport reads; :class:`SyncConfig` adds a section
    per transport."""

    #: a transport of titan_rl/sync/transports' table. tensor: colocated, SGLang's
    #: update_weights_from_tensor (shared memory on CPU, CUDA/MUSA IPC on GPU); distributed:
    #: broadcast from trainer rank 0; disk: HF safetensors written atomically, then
    #: update_weights_from_disk; mooncake: TransferEngine writes into buffers registered by
    #: an agent next to each engine. Its settings: the section of its name.
    transport: TransportName = "tensor"
    #: flattened bucket size (one tensor larger than this travels alone).
    bucket_bytes: PositiveInt = 512 << 20
    #: dtype sent to the engines (None: the trainer's parameter dtype).
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    #: colocated engines (engines.colocate) release their memory while the trainer trains
    #: and get their weights back before the sync; true: the sync resumes their KV cache and
    #: CUDA graphs once the new weights are loaded, before generation continues and before the
    #: parity probe (slime's order, so the transfer has that memory). None: true when
    #: engines.colocate (the GRPO loop decides); false: the loop resumes all memory first.
    resume_kv_cache: bool | None = None
    #: pause mode around the update (SGLang's pause_generation modes).
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"
    #: run the logprob parity check on the first sync and every N-th after it (0: never;
    #: 1: every sync). Each check is a trainer forward and an engine logprob request on the
    #: probe; the first one catches a wrong mapping before any rollout uses it.
    check_every: int = Field(10, ge=0)
    #: above this mean |engine - trainer| logprob difference: error (strict) or warning.
    max_logprob_diff: float = Field(1e-2, gt=0)
    #: true: a parity check above ``max_logprob_diff`` stops the run; false: a warning.
    strict: bool = False
    #: the parity probe: this many random sequences ...
    probe_num_sequences: PositiveInt = 2
    #: ... of this many tokens ...
    probe_length: PositiveInt = 32
    #: ... drawn with this seed.
    probe_seed: int = 0
    #: the weight_version engines report before any sync (SGLang's default); an engine still
    #: on it serves its --model-path, which is then the restore point after a failed sync.
    initial_version: str = "default"
    #: seconds one sync call to an engine may take.
    timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in MOVED_KEYS.items():
                if old in data:
                    raise ValueError(
                        f"sync.{old} is now sync.{new} (each transport's settings are in "
                        "the section of its name); rename the key"
                    )
        return data

    @model_validator(mode="after")
    def _check(self) -> SyncConfig:
        # a section differing from its defaults: a dump of this config validates again
        stray = [
            name
            for name in TRANSPORTS
            if name != self.transport and getattr(self, name) != type(getattr(self, name))()
        ]
        if stray:
            raise ValueError(
                f"sync.{stray[0]} is set but sync.transport is {self.transport!r}: only the "
                f"chosen transport's section is read; set sync.transport={stray[0]} or remove "
                f"sync.{stray[0]}"
            )
        problem = self.settings.chosen_problem()
        if problem:
            raise ValueError(problem)
        return self

    @property
    def settings(self) -> TransportSection:
        """The chosen transport's section."""
        return getattr(self, self.transport)

    def with_agents(self, agents: list[str]) -> SyncConfig:
        """This config with the Mooncake agents the GRPO job started beside its engines (one
        per engine, in their order) as ``sync.mooncake.agents``, which must be empty."""
        if self.transport != "mooncake" or self.mooncake.agents:  # type: ignore[attr-defined]
            raise ValueError(
                "agents started beside the engines are for sync.transport=mooncake with "
                f"sync.mooncake.agents empty (here: sync.transport={self.transport})"
            )
        mooncake = self.mooncake.model_copy(update={"agents": list(agents)})  # type: ignore[attr-defined]
        return self.model_copy(update={"mooncake": mooncake})


#: the sync section: :class:`SyncKeys` and, for each transport of the table, its settings
#: section ``sync.<name>`` (its transport module's ``settings_class``)
SyncConfig = create_model(
    "SyncConfig",
    __base__=SyncKeys,
    __module__=__name__,
    __doc__="The ``sync`` section: the keys every transport reads, and a section per transport.",
    **{
        name: (t.settings_class, Field(default_factory=t.settings_class))
        for name, t in TRANSPORTS.items()
    },
)
