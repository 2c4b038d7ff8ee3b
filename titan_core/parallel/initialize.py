"""Start-up: check the layout, pick the accelerator, create process groups, seed RNGs."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from titan_core.accelerator import Accelerator, get_accelerator
from titan_core.accelerator.megatron_compat import install_megatron_compat
from titan_core.config import ConfigError
from titan_core.config.pretrain import PretrainConfig, check_layout
from titan_core.net import free_port, node_address
from titan_core.parallel.nodes import bind_gloo, clear_nodes, gather_nodes, unbind_gloo
from titan_core.parallel.peer_watch import close_watch, open_watch


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


def dist_env() -> DistEnv:
    """Rank, world size and local rank from torchrun's environment (1 process without it)."""
    return DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def set_random_seed(seed: int, pp_rank: int) -> None:
    """Megatron's seeding: per pipeline stage offset, then the model-parallel RNG tracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def initialize(cfg: PretrainConfig) -> tuple[Accelerator, DistEnv, int]:
    """Everything before the model: returns (accelerator, env, data-parallel size).

    The layout is checked against the world size first, so a bad config fails before any
    process group starts. Each rank binds its gloo groups to its node's address when one is
    known (``titan_core.parallel.nodes``), and learns every rank's node; across torchrun
    nodes, each node's first rank watches the others (``titan_core.parallel.peer_watch``).
    """
    from megatron.core import parallel_state

    env = dist_env()
    dp = check_layout(cfg, env.world_size)
    accel = get_accelerator()
    install_megatron_compat(accel)
    accel.set_device(accel.resolve_visible_device_id(env.local_rank))
    p = cfg.parallel
    address = None
    if not dist.is_initialized():
        try:  # several nodes; or one rank told its node (a GRPO trainer rank on a Ray cluster)
            address = node_address()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if address:  # every gloo group from here on: this one, megatron's, the weight sync's
            bind_gloo(address)
        if env.world_size == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group(
            backend=accel.communication_backend(),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(minutes=p.distributed_timeout_minutes),
            device_id=accel.distributed_device_id(env.local_rank),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        distributed_timeout_minutes=p.distributed_timeout_minutes,
    )
    across_nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
    watch = open_watch(address) if across_nodes and address and env.local_rank == 0 else None
    places = gather_nodes(address, watch.port if watch else 0, collective=across_nodes)
    if watch is not None:
        watch.start(env.rank, places)
    set_random_seed(cfg.train.seed, parallel_state.get_pipeline_model_parallel_rank())
    return accel, env, dp


def shutdown() -> None:
    """Destroy megatron's groups and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    close_watch()
    unbind_gloo()
    clear_nodes()
