"""``python -m adapters.slime.train <slime arguments>``: slime's RL loop, trained by Titan.

The loop is slime's ``train.py``: slime's ``create_placement_groups`` and
``create_training_models(..., actor_cls=TitanTrainActor)`` (its ``RayTrainGroup`` runs the
trainer ranks), a rollout manager producing slime's train data, ``update_weights`` first,
then per rollout: generate -> train -> save -> update weights -> evaluate. Two slime modules
are replaced, because both import ``sglang`` (no CPU build) at the top:
``slime.utils.arguments`` by ``adapters.slime.arguments`` (slime's flag names and defaults)
and ``slime.ray.rollout.RolloutManager`` by ``adapters.slime.rollout.TitanRolloutManager``
(the same methods, Titan's engines). Everything else that runs is slime's own code.

Example (CPU, the demo's arithmetic task; ``make demo``'s base is pretrained if missing)::

    python -m adapters.slime.train --titan-config examples/math.yaml \\
        --num-rollout 60 --rollout-batch-size 32 --n-samples-per-prompt 8 \\
        --rollout-max-response-len 6 --rollout-stop-token-ids 10 256 \\
        --custom-rm-path adapters.slime.rewards.exact_match --eval-interval 20 \\
        --eval-temperature 0

One status line per rollout; ``<run dir>/metrics.jsonl`` and ``reward.png``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from adapters.common.driver import (
    EXIT_CONFIG_ERROR,
    EXIT_RUN_ERROR,
    colocated_offload,
    engines_start_beside_trainers,
    finish_run,
    prepare,
    ray_init,
    start_policy,
    status_line,
)
from adapters.common.job import (
    RolloutProgress,
    job_services,
    ray_init_under,
    stop_manager,
    stopped_line,
    wait_or_stop,
)
from titan_core.config import ConfigError
from titan_core.signals import StopSignals


def train(args: Any) -> int:
    from adapters.slime.accelerator import register

    cfg = prepare(args)
    run_dir = start_policy(args, cfg)
    offload_train = colocated_offload(args)
    register()
    with job_services(run_dir, args.save) as stop:
        if stop.requested is not None:
            print(f"stopped by {stop.name} before RL started; rerun the same command", flush=True)
            return stop.exit_code
        return _train(args, cfg, run_dir, offload_train, stop)


def _train(args: Any, cfg: Any, run_dir: Any, offload_train: bool, stop: StopSignals) -> int:
    import ray

    from adapters.common.tracking import Tracking
    from adapters.peers import import_peer
    from adapters.slime.actor import TitanTrainActor
    from adapters.slime.rollout import TitanRolloutManager
    from titan_core.training.metrics import MetricsWriter

    placement = import_peer("slime.ray.placement_group")
    ray_init_under(stop, lambda: ray_init(args))
    tracking = Tracking(args, "slime", run_dir)  # slime's wandb / TensorBoard, as its flags say
    pgs = placement.create_placement_groups(args)
    manager = ray.remote(TitanRolloutManager).options(num_cpus=0).remote(args, pgs["rollout"])
    manager_busy = False  # killed mid-rollout by a stop signal: no dispose
    writer = None
    progress: RolloutProgress | None = None
    try:
        # slime: --num-epoch passes over --prompt-data; known before the trainers are made,
        # as in slime (--num-rollout is their LR schedule's horizon)
        if args.num_rollout is None:
            per_epoch = ray.get(manager.get_num_rollout_per_epoch.remote())
            args.num_rollout = args.num_epoch * per_epoch
        engines = None
        if engines_start_beside_trainers(args):  # the manager answers the rest after it
            engines = manager.start_engines.remote(args.hf_checkpoint)
        actor_model, _ = placement.create_training_models(
            args, pgs, manager, actor_cls=TitanTrainActor
        )
        ray.get(manager.set_trainers.remote(actor_model._actor_handlers))
        start = args.start_rollout_id
        progress = RolloutProgress(start)
        if args.rollout_global_dataset:  # the prompts' position after the resumed rollout
            ray.get(manager.load.remote(start - 1))
        if engines is None:
            engines = manager.start_engines.remote(args.hf_checkpoint)
        ray.get(engines)
        actor_model.update_weights()  # slime's first step: the engines serve the policy
        if offload_train:
            actor_model.offload()
        writer = MetricsWriter(run_dir / "metrics.jsonl", truncate_after=start)
        if start == 0 and args.eval_interval is not None and not args.skip_eval_before_train:
            done, ev = wait_or_stop(manager.eval.remote(0), stop)
            manager_busy = not done
            if done:
                writer.write({"step": 0, **ev})
                tracking.log({"step": 0, **ev})
                print(f"rollout    0 | eval acc {ev.get('eval/accuracy', 0.0):.3f} (before RL)")
        last = time.perf_counter()
        for rollout_id in range(start, args.num_rollout):
            if stop.requested is not None:
                break
            t0 = time.perf_counter()
            done, refs = wait_or_stop(manager.generate.remote(rollout_id), stop)
            if not done:  # the rollout is abandoned; the last completed one is saved
                manager_busy = True
                break
            rollout_metrics = ray.get(manager.get_metrics.remote())
            # the prompts' position after this rollout, beside any checkpoint of it (also
            # the one a stop signal saves)
            ray.get(manager.save.remote(rollout_id))
            if args.offload_rollout:
                ray.get(manager.offload.remote())
            if offload_train:
                actor_model.onload()
            t1 = time.perf_counter()
            train_metrics = ray.get(actor_model.async_train(rollout_id, refs))[0] or {}
            progress.completed = rollout_id
            t2 = time.perf_counter()
            if args.save_interval and (rollout_id + 1) % args.save_interval == 0:
                actor_model.save_model(rollout_id)
                progress.saved = rollout_id
            if stop.requested is not None:  # trained: recorded and saved, no sync or eval
                rec = {"step": rollout_id + 1, **rollout_metrics, **train_metrics,
                       "time/rollout": t1 - t0, "time/train": t2 - t1}  # fmt: skip
                writer.write(rec)
                tracking.log(rec)
                break
            if args.offload_rollout:
                ray.get(manager.onload_weights.remote())
            t3 = time.perf_counter()
            synced = actor_model.update_weights()
            if args.offload_rollout:
                ray.get(manager.onload_kv.remote())
            slept = actor_model.offload() if offload_train else None
            t4 = time.perf_counter()
            rec: dict[str, Any] = {"step": rollout_id + 1, **rollout_metrics, **train_metrics}
            if slept and isinstance(slept[0], dict):  # memory/device_bytes_*_sleep
                rec.update(slept[0])
            if isinstance(synced, list) and synced and isinstance(synced[0], dict):
                rec.update(synced[0])
            if args.eval_interval and (rollout_id + 1) % args.eval_interval == 0:
                done, ev = wait_or_stop(manager.eval.remote(rollout_id), stop)
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
            print(status_line(rec, args.num_rollout), flush=True)
        if stop.requested is not None:
            if progress.needs_save(cfg.run.save_on_signal):
                if offload_train:
                    actor_model.onload()
                actor_model.save_model(progress.completed)
                progress.saved = progress.completed
            print(stopped_line(stop, progress, args.save, cfg.run.save_on_signal), flush=True)
            return stop.exit_code
        if args.num_rollout > start:
            if offload_train:
                actor_model.onload()
            actor_model.save_model(args.num_rollout - 1)
            ray.get(manager.save.remote(args.num_rollout - 1))
        writer.close()
        writer = None
        finish_run(run_dir, "GRPO: slime's loop, Titan's trainer")
    finally:
        if writer is not None:
            writer.close()
        tracking.finish()
        if manager_busy:
            stop_manager(manager)
        else:
            ray.get(manager.dispose.remote())
        from titan_rl.placement import shutdown_local_ray

        shutdown_local_ray()  # ray.shutdown() without its 1 s wait on the monitor
    return 0


def main(argv: list[str] | None = None) -> int:
    from adapters.peers import PeerImportError
    from adapters.slime.arguments import parse_args
    from titan_rl.data import DatasetError
    from titan_rl.rewards.errors import RewardError

    args = parse_args(argv)
    try:
        return train(args)
    except (ConfigError, PeerImportError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except RewardError as e:  # from the rollout manager (a Ray error wrapping it)
        print(f"error: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return EXIT_RUN_ERROR


if __name__ == "__main__":
    from titan_core.process_exit import exit_process

    exit_process(main())
