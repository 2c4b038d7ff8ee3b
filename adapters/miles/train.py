"""``python -m adapters.miles.train <miles arguments>``: miles' RL loop, trained by Titan.

The loop is miles' ``train.py``: placement groups, the rollout manager, the trainer group
(miles' own ``RayTrainGroup``, ``miles.ray.actor_group``), ``init`` -> ``set_rollout_manager``
-> ``update_weights`` first, then per rollout: generate -> train -> save -> update weights ->
evaluate, all through miles' group and its actor contract.

**The one substitution.** miles has no actor registry: ``RayTrainGroup.__init__`` creates
its trainer actors with ``allocate_gpus_for_actor`` (``miles.ray.train.actor_factory``),
which picks ``MegatronTrainRayActor`` or ``FSDPTrainRayActor`` by ``--train-backend``.
:func:`titan_train_actors` is a context manager, entered by this driver around the creation
of the group and nowhere else, that points the group module's ``allocate_gpus_for_actor``
at :func:`allocate_titan_actors` (the same placement: one Ray actor per trainer rank on the
rank's bundle, rank 0's rendezvous address for the others, miles' environment) and restores
miles' function on exit. miles' group calls the allocator only in its constructor, so no
actor is made outside the block. Nothing is changed at import time.

Replaced miles modules, each because it imports ``sglang`` (no CPU build) at the top:
``miles.utils.arguments`` (-> ``adapters.miles.arguments``), ``miles.ray.placement_group``
(imports the rollout manager; -> :func:`create_placement_groups`, the same
``(pg, bundle indices, GPU ids)`` triples), ``miles.ray.rollout.rollout_manager``
(-> ``adapters.miles.rollout.TitanRolloutManager``), ``miles.utils.data``
(-> ``adapters.miles.train_data``), miles' rollout functions and data sources
(-> ``adapters.miles.generate``, ``adapters.miles.data_source``). miles' fault-tolerant
group (``MILES_EXPERIMENTAL_FT_TRAINER``), critic, OPD and multi-LoRA are refused.

Example (CPU, the demo's arithmetic task; its base is pretrained if missing)::

    python -m adapters.miles.train --titan-config examples/math.yaml \\
        --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \\
        --num-rollout 60 --rollout-batch-size 32 --n-samples-per-prompt 8 \\
        --custom-rm-path adapters.slime.rewards.exact_match --eval-interval 20 \\
        --eval-temperature 0
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

from adapters.common.driver import (
    EXIT_CONFIG_ERROR,
    EXIT_RUN_ERROR,
    engines_start_beside_trainers,
    finish_run,
    prepare,
    ray_init,
    start_policy,
    status_line,
)
from adapters.common.job import (
    RolloutProgress,
    await_or_stop,
    job_services,
    ray_init_under,
    stop_manager,
    stopped_line,
)
from titan_core.config import ConfigError
from titan_core.signals import StopSignals

#: trainer actors' share of a bundle's device, as miles' allocate_train_group asks
NUM_GPUS_PER_ACTOR = 0.4


def create_placement_groups(args: Any) -> dict[str, Any]:
    """miles' placement: one group of ``{"GPU": 1, "CPU": 1}`` bundles (trainer ranks,
    then rollout devices; shared when colocated, none for external engines), bundles
    ordered by node and GPU id; ``{"actor": triple, "rollout": triple}``."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.colocate:
        total, rollout_offset = max(actor, args.rollout_num_gpus), 0
    elif args.rollout_external:
        total, rollout_offset = actor, actor
    else:
        total, rollout_offset = actor + args.rollout_num_gpus, actor
    pg = placement_group([{"GPU": 1, "CPU": 1}] * total, strategy="PACK")
    ray.get(pg.ready())

    @ray.remote(num_gpus=1, num_cpus=0)
    def where() -> tuple[str, int]:
        return ray.util.get_node_ip_address(), int(ray.get_gpu_ids()[0])

    found = ray.get([
        where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote()
        for i in range(total)
    ])  # fmt: skip
    order = sorted(range(total), key=lambda i: (_node_key(found[i][0]), found[i][1]))
    gpu_ids = [found[i][1] for i in order]
    return {
        "actor": (pg, order, gpu_ids),
        "rollout": (pg, order[rollout_offset:], gpu_ids[rollout_offset:]),
    }


def _node_key(node: str) -> tuple[int, ...]:
    """An IPv4 address by its numbers, anything else by its characters."""
    parts = node.split(".")
    return tuple(map(int, parts)) if all(p.isdigit() for p in parts) else tuple(map(ord, node))


def train_env(args: Any) -> dict[str, str]:
    """The environment miles' ``actor_factory.allocate_gpus_for_actor`` gives each trainer
    rank (its keys checked against miles' source by tests/adapters/test_miles_scripts.py):
    every device visible (the rank picks its own, LOCAL_RANK = its GPU id), NCCL's cuMem off
    (SGLang turns it off), TE's blockwise-FP8 fp32 scales, NVSHMEM without NCCL (DeepEP),
    miles' dumper config, then ``--train-env-vars``. torch_memory_saver's preload hook is
    the offload's own (``adapters.common.driver.colocated_offload``)."""
    import os

    from adapters.peers import import_peer

    noset = import_peer("miles.ray.utils").NOSET_VISIBLE_DEVICES_ENV_VARS_LIST
    environ = import_peer("miles.utils.environ")
    env = {name: "1" for name in noset}
    env["NCCL_CUMEM_ENABLE"] = os.environ.get("NCCL_CUMEM_ENABLE", "0")
    env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = os.environ.get(
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES", environ.default_fp8_block_scaling_fp32_scales()
    )
    env["NVSHMEM_DISABLE_NCCL"] = os.environ.get("NVSHMEM_DISABLE_NCCL", "1")
    if config := getattr(args, "dumper_source_patcher_config_train", None):
        env["DUMPER_SOURCE_PATCHER_CONFIG"] = config
    return {**env, **(args.train_env_vars or {})}


def allocate_titan_actors(
    args: Any,
    gpus_per_cell: int,
    pg: tuple[Any, list[int], list[int]],
    num_gpus_per_actor: float,
    indep_dp_store_addr: str | None,
    role: str,
    cell_index: int,
) -> list[Any]:
    """miles' ``allocate_gpus_for_actor`` signature and placement, with
    :class:`adapters.miles.actor.TitanTrainRayActor` as every rank's class."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from adapters.miles.actor import TitanTrainRayActor

    env = train_env(args)
    remote_cls = ray.remote(num_gpus=1, runtime_env={"env_vars": env})(TitanTrainRayActor)
    placement_group, bundles, _ = pg
    handles: list[Any] = []
    master: tuple[Any, Any] = (None, None)
    for rank in range(gpus_per_cell):
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundles[rank]
        )
        handle = remote_cls.options(
            num_cpus=num_gpus_per_actor, num_gpus=num_gpus_per_actor, scheduling_strategy=strategy
        ).remote(
            args, gpus_per_cell, rank, *master,
            indep_dp_store_addr=indep_dp_store_addr, role=role, cell_index=cell_index,
        )  # fmt: skip
        if rank == 0:
            master = tuple(ray.get(handle.get_master_addr_and_port.remote()))
        handles.append(handle)
    return handles


@contextlib.contextmanager
def titan_train_actors() -> Iterator[list[Any]]:
    """Within the block, miles' ``RayTrainGroup`` (``miles.ray.actor_group``) makes
    :class:`TitanTrainRayActor` ranks; yields the list of the handles it made (filled as
    groups are created). miles' allocator is restored on exit."""
    from adapters.peers import import_peer

    # miles' v2 trainer group (MILES_EXPERIMENTAL_FT_TRAINER) imports the allocator itself,
    # so inside this block it would build miles' Megatron ranks: refused, in miles' own
    # driver as in Titan's
    refuse_ft_trainer()
    group_mod = import_peer("miles.ray.actor_group")
    made: list[Any] = []
    original = group_mod.allocate_gpus_for_actor

    def allocate(**kwargs: Any) -> list[Any]:
        handles = allocate_titan_actors(**kwargs)
        made.extend(handles)
        return handles

    group_mod.allocate_gpus_for_actor = allocate
    try:
        yield made
    finally:
        group_mod.allocate_gpus_for_actor = original


def refuse_ft_trainer() -> None:
    """miles' fault-tolerant trainer (``MILES_EXPERIMENTAL_FT_TRAINER``, its v2 group of
    cells with in-memory healing) is not run by the Titan backend: a ConfigError."""
    from adapters.peers import import_peer

    if import_peer("miles.utils.environ").enable_experimental_ft_trainer():
        raise ConfigError(
            "MILES_EXPERIMENTAL_FT_TRAINER is set: miles' fault-tolerant trainer cells (and "
            "their in-memory healing) are not supported by the Titan backend; unset it (a "
            "Titan run resumes from --save after a failure)"
        )


def check_supported(args: Any) -> None:
    """miles features this backend does not run, refused before anything starts."""
    refuse_ft_trainer()
    for name, what in (("use_critic", "a critic (PPO)"), ("use_opd", "on-policy distillation"),
                       ("indep_dp", "independent-DP cells"), ("multi_lora", "multi-LoRA")):  # fmt: skip
        if getattr(args, name, False):
            raise ConfigError(f"{what} is not supported by the Titan backend")


async def build_trainer_group(
    args: Any, pgs: dict[str, Any], manager: Any
) -> tuple[Any, list[Any]]:
    """miles' ``RayTrainGroup`` of Titan ranks, initialised and told the rollout manager
    (miles' ``create_training_models``); (group, the ranks' handles)."""
    from adapters.peers import import_peer

    group_cls = import_peer("miles.ray.actor_group").RayTrainGroup
    with titan_train_actors() as actors:
        group = group_cls(
            args, args.actor_num_nodes, args.actor_num_gpus_per_node, pgs["actor"],
            rollout_manager=manager, num_gpus_per_actor=NUM_GPUS_PER_ACTOR, role="actor",
            with_ref=bool(args.use_kl_loss), with_opd_teacher=False,
        )  # fmt: skip
    starts = await group.init()
    if len(set(starts)) != 1:
        raise RuntimeError(f"trainer ranks resume at different rollouts: {starts}")
    if args.start_rollout_id is None:
        args.start_rollout_id = starts[0]
    await group.set_rollout_manager()
    if args.rollout_global_dataset:
        await manager.load.remote(args.start_rollout_id - 1)
    return group, list(actors)


async def train(args: Any) -> int:
    check_supported(args)
    cfg = prepare(args)
    run_dir = start_policy(args, cfg)
    with job_services(run_dir, args.save) as stop:
        if stop.requested is not None:
            print(f"stopped by {stop.name} before RL started; rerun the same command", flush=True)
            return stop.exit_code
        return await _train(args, cfg, run_dir, stop)


async def _train(args: Any, cfg: Any, run_dir: Any, stop: StopSignals) -> int:
    import ray

    from adapters.common.tracking import Tracking
    from adapters.miles.rollout import TitanRolloutManager
    from adapters.peers import import_peer
    from titan_core.training.metrics import MetricsWriter

    ray_init_under(stop, lambda: ray_init(args))
    tracking = Tracking(args, "miles", run_dir)  # miles' wandb / TensorBoard / MLflow / Prometheus
    import_peer("miles.utils.object_store").init_instance(args, contribute_segment=False)
    pgs = create_placement_groups(args)
    manager = ray.remote(TitanRolloutManager).options(num_cpus=0).remote(args, pgs["rollout"])
    manager_busy = False  # killed mid-rollout by a stop signal: no dispose
    writer = None
    actors: list[Any] = []
    try:
        engines = None
        if engines_start_beside_trainers(args):  # the manager answers the rest after it
            engines = manager.start_engines.remote(args.hf_checkpoint)
        group, actors = await build_trainer_group(args, pgs, manager)
        await manager.set_trainers.remote(actors)
        if engines is None:
            engines = manager.start_engines.remote(args.hf_checkpoint)
        await engines
        await group.update_weights()  # miles' first step: the engines serve the policy
        start, total = args.start_rollout_id, args.num_rollout
        progress = RolloutProgress(start)
        # a resumed run drops the records of rollouts after its checkpoint (run again)
        writer = MetricsWriter(run_dir / "metrics.jsonl", truncate_after=start)
        if start == 0 and args.eval_interval is not None and not args.skip_eval_before_train:
            done, ev = await await_or_stop(manager.eval.remote(0), stop)
            manager_busy = not done
            if done:
                writer.write({"step": 0, **ev})
                tracking.log({"step": 0, **ev})
                print(f"rollout    0 | eval acc {ev.get('eval/accuracy', 0.0):.3f} (before RL)")
        last = time.perf_counter()
        for rollout_id in range(start, total):
            if stop.requested is not None:
                break
            t0 = time.perf_counter()
            done, pack = await await_or_stop(manager.generate.remote(rollout_id), stop)
            if not done:  # the rollout is abandoned; the last completed one is saved
                manager_busy = True
                break
            rec: dict[str, Any] = {"step": rollout_id + 1, **await manager.get_metrics.remote()}
            # the prompts' position after this rollout, beside any checkpoint of it (also
            # the one a stop signal saves)
            await manager.save.remote(rollout_id)
            if args.colocate:
                await manager.offload.remote()
            t1 = time.perf_counter()
            await group.train(rollout_id, pack)
            progress.completed = rollout_id
            t2 = time.perf_counter()
            if args.save_interval and (rollout_id + 1) % args.save_interval == 0:
                await group.save_model(rollout_id)
                progress.saved = rollout_id
            if stop.requested is not None:  # trained: recorded and saved, no sync or eval
                rec.update(await actors[0].get_metrics.remote())
                rec.update({"time/rollout": t1 - t0, "time/train": t2 - t1})
                writer.write(rec)
                tracking.log(rec)
                break
            if args.colocate:
                await group.offload()
                await manager.onload_weights.remote()
            t3 = time.perf_counter()
            await group.update_weights(rollout_id=rollout_id)
            if args.colocate:
                await manager.onload_kv.remote()
            t4 = time.perf_counter()
            rec.update(await actors[0].get_metrics.remote())
            if args.eval_interval and (rollout_id + 1) % args.eval_interval == 0:
                done, ev = await await_or_stop(manager.eval.remote(rollout_id), stop)
                manager_busy = not done
                rec.update(ev or {})
            t5 = time.perf_counter()
            rec.update({
                "time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t4 - t3,
                "time/eval": t5 - t4, "time/step": t5 - last,
            })  # fmt: skip
            last = t5
            writer.write(rec)
            tracking.log(rec)
            print(status_line(rec, total), flush=True)
        if stop.requested is not None:
            if progress.needs_save(cfg.run.save_on_signal):
                await group.save_model(progress.completed, force_sync=True)
                progress.saved = progress.completed
            print(stopped_line(stop, progress, args.save, cfg.run.save_on_signal), flush=True)
            return stop.exit_code
        if total > start:
            await group.save_model(total - 1, force_sync=True)
            await manager.save.remote(total - 1)
        writer.close()
        writer = None
        finish_run(run_dir, "GRPO: miles' loop, Titan's trainer")
    finally:
        if writer is not None:
            writer.close()
        tracking.finish()
        # the ranks leave their process groups before Ray ends their processes
        await asyncio.gather(*(a.shutdown.remote() for a in actors))
        if manager_busy:
            stop_manager(manager)
        else:
            await manager.dispose.remote()
        from titan_rl.placement import shutdown_local_ray

        shutdown_local_ray()  # ray.shutdown() without its 1 s wait on the monitor
    return 0


def main(argv: list[str] | None = None) -> int:
    from adapters.miles.arguments import parse_args
    from adapters.peers import PeerImportError
    from titan_rl.data import DatasetError
    from titan_rl.rewards.errors import RewardError

    args = parse_args(argv)
    try:
        return asyncio.run(train(args))
    except (ConfigError, PeerImportError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except RewardError as e:  # from the rollout manager (a Ray error wrapping it)
        print(f"error: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return EXIT_RUN_ERROR


if __name__ == "__main__":
    from titan_core.process_exit import exit_process

    exit_process(main())
