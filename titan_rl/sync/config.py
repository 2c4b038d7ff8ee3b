"""The ``sync`` section: how trainer weights reach the rollout engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from titan_core.config.loader import Section


class SyncConfig(Section):
    #: tensor: colocated, SGLang's update_weights_from_tensor (shared memory on CPU, CUDA/MUSA
    #: IPC on GPU); distributed: broadcast from trainer rank 0; disk: HF safetensors written
    #: atomically, then update_weights_from_disk; mooncake: TransferEngine writes into buffers
    #: registered by an agent next to each engine (``sync.mooncake_agents``).
    transport: Literal["tensor", "distributed", "disk", "mooncake"] = "tensor"
    #: tensor transport, what a request carries. flattened_bucket (default, what slime does):
    #: each bucket is copied into one staging buffer, so an engine opens one shared-memory
    #: segment / IPC handle per bucket, but the weights are copied twice (trainer, then engine).
    #: direct (``load_format="direct"``): the trainer's parameter tensors themselves (shared
    #: memory on CPU, where the first sync moves them, so /dev/shm must hold the model; CUDA/MUSA
    #: IPC on GPU), one copy (the engine's) instead of two. Temporaries (dtype casts, TP/EP/PP-
    #: gathered tensors, q/k/v on GPU) are still staged; on CPU q/k/v are written into shared
    #: memory kept for the run.
    tensor_format: Literal["flattened_bucket", "direct"] = "flattened_bucket"
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
    strict: bool = False
    probe_num_sequences: PositiveInt = 2
    probe_length: PositiveInt = 32
    probe_seed: int = 0
    #: disk transport: where versions are written (one folder per version).
    disk_dir: str | None = None
    #: disk transport: keep this many newest versions on disk (>= 1: the restore point).
    disk_keep: PositiveInt = 2
    #: distributed transport: rendezvous address the engines can reach; port 0 picks one.
    master_address: str = "127.0.0.1"
    master_port: int = Field(0, ge=0, lt=65536)
    group_name: str = "titan_weight_sync"
    #: process-group backend (None: the accelerator's weight-update backend).
    backend: str | None = None
    #: mooncake transport: one agent URL per engine (``python -m titan_rl.sync.mooncake_agent``).
    mooncake_agents: list[str] = Field(default_factory=list)
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device: str = ""
    mooncake_host: str = "127.0.0.1"
    #: the weight_version engines report before any sync (SGLang's default); an engine still
    #: on it serves its --model-path, which is then the restore point after a failed sync.
    initial_version: str = "default"
    timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> SyncConfig:
        if self.transport == "disk" and not self.disk_dir:
            raise ValueError("sync.disk_dir is required when sync.transport=disk")
        if self.transport == "mooncake" and not self.mooncake_agents:
            raise ValueError(
                "sync.transport=mooncake needs sync.mooncake_agents: one agent URL per engine "
                "(start `python -m titan_rl.sync.mooncake_agent --engine-url ...` beside each)"
            )
        return self
