"""The ``sync`` section: how trainer weights reach the rollout engines.

``sync.transport`` picks the transport; its settings are the section of the same name
(``sync.tensor``, ``sync.disk``, ``sync.distributed``, ``sync.mooncake``), and only that
section may be set. The keys outside them apply to every transport.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from titan_core.config.loader import Section

Transport = Literal["tensor", "distributed", "disk", "mooncake"]


class TensorSync(Section):
    """``sync.tensor``: SGLang's update_weights_from_tensor (colocated engines)."""

    #: what a request carries. flattened_bucket (default, what slime does): each bucket is
    #: copied into one staging buffer, so an engine opens one shared-memory segment / IPC
    #: handle per bucket, but the weights are copied twice (trainer, then engine). direct
    #: (``load_format="direct"``): the trainer's parameter tensors themselves (shared memory
    #: on CPU, where the first sync moves them, so /dev/shm must hold the model; CUDA/MUSA IPC
    #: on GPU), one copy (the engine's) instead of two. Temporaries (dtype casts, TP/EP/PP-
    #: gathered tensors, q/k/v on GPU) are still staged; on CPU q/k/v are written into shared
    #: memory kept for the run.
    format: Literal["flattened_bucket", "direct"] = "flattened_bucket"


class DiskSync(Section):
    """``sync.disk``: HF safetensors written atomically, then update_weights_from_disk."""

    #: where versions are written (one folder per version); required with this transport.
    dir: str | None = None
    #: keep this many newest versions on disk (>= 1: the restore point).
    keep: PositiveInt = 2


class DistributedSync(Section):
    """``sync.distributed``: a process group per sender (each pipeline stage's source rank,
    each EP rank sending its experts) with every engine; one broadcast per bucket."""

    #: the address each sender hosts its group's rendezvous on, as the engines reach it;
    #: "auto": each sender host's own address (senders on several hosts).
    master_address: str = "127.0.0.1"
    #: rendezvous port of sender 0 (sender i: this + i); 0 picks free ones.
    master_port: int = Field(0, ge=0, lt=65536)
    #: the process groups' name prefix (a stage's group: ``<group_name>-pp_<stage>``; an EP
    #: rank sending its experts alone: ``<group_name>-pp_<stage>-ep_<rank>``).
    group_name: str = "titan"
    #: process-group backend (None: the accelerator's weight-update backend).
    backend: str | None = None


class MooncakeSync(Section):
    """``sync.mooncake``: TransferEngine writes into buffers registered by an agent beside
    each engine (``python -m titan_rl.sync.mooncake_agent``)."""

    #: one agent URL per engine, in the engines' order; required with this transport.
    agents: list[str] = Field(default_factory=list)
    #: the TransferEngine's protocol.
    protocol: Literal["tcp", "rdma"] = "tcp"
    #: the RDMA device ("": Mooncake's choice).
    device: str = ""
    #: this trainer's address as the agents reach it.
    host: str = "127.0.0.1"


TransportSettings = TensorSync | DiskSync | DistributedSync | MooncakeSync
#: the transports' sections, by ``sync.transport``
SECTIONS = ("tensor", "disk", "distributed", "mooncake")

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


class SyncConfig(Section):
    #: tensor: colocated, SGLang's update_weights_from_tensor (shared memory on CPU, CUDA/MUSA
    #: IPC on GPU); distributed: broadcast from trainer rank 0; disk: HF safetensors written
    #: atomically, then update_weights_from_disk; mooncake: TransferEngine writes into buffers
    #: registered by an agent next to each engine. Its settings: the section of its name.
    transport: Transport = "tensor"
    #: settings of ``transport: tensor``.
    tensor: TensorSync = Field(default_factory=TensorSync)
    #: settings of ``transport: disk``.
    disk: DiskSync = Field(default_factory=DiskSync)
    #: settings of ``transport: distributed``.
    distributed: DistributedSync = Field(default_factory=DistributedSync)
    #: settings of ``transport: mooncake``.
    mooncake: MooncakeSync = Field(default_factory=MooncakeSync)
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
    #: run the logprob parity check every N syncs (0: never).
    check_every: int = Field(1, ge=0)
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
            for name in SECTIONS
            if name != self.transport and getattr(self, name) != type(getattr(self, name))()
        ]
        if stray:
            raise ValueError(
                f"sync.{stray[0]} is set but sync.transport is {self.transport!r}: only the "
                f"chosen transport's section is read; set sync.transport={stray[0]} or remove "
                f"sync.{stray[0]}"
            )
        if self.transport == "disk" and not self.disk.dir:
            raise ValueError(
                "sync.transport=disk needs sync.disk.dir: the folder the versions are written to"
            )
        if self.transport == "mooncake" and not self.mooncake.agents:
            raise ValueError(
                "sync.transport=mooncake needs sync.mooncake.agents: one agent URL per engine "
                "(start `python -m titan_rl.sync.mooncake_agent --engine-url ...` beside each)"
            )
        return self

    @property
    def settings(self) -> TransportSettings:
        """The chosen transport's section."""
        return getattr(self, self.transport)
