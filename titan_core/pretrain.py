"""``python -m titan_core.pretrain --config FILE.yaml [key.sub=value ...]`` (also under torchrun).

Trains a dense or MoE GPT with megatron-core on MUSA, CUDA or CPU (chosen automatically,
or by ``TITAN_ACCELERATOR``). Writes ``<run.dir>/metrics.jsonl`` and checkpoints, and
resumes from the last complete checkpoint when started again.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from titan_core import startup_gc
from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import PretrainConfig
from titan_core.launcher_watch import launched_by_torchrun, watch_launcher
from titan_core.run_lock import lock_for_rank
from titan_core.startup import check_startup

EXIT_CONFIG_ERROR = 2
EXIT_CHECKPOINT_ERROR = 1
#: another rank's process or node is gone (its connection lost): the job stops, rerun resumes
EXIT_LOST_PEER = 1


def parse_args(argv: list[str] | None = None) -> tuple[str | None, list[str]]:
    ap = argparse.ArgumentParser(
        prog="python -m titan_core.pretrain",
        description="Train a GPT with megatron-core. Overrides: key.sub=value, e.g. train.lr=3e-4",
    )
    ap.add_argument("--config", help="YAML config (see examples/)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = ap.parse_args(argv)
    return args.config, args.overrides


def main(argv: list[str] | None = None) -> int:
    with startup_gc.paused():  # run() settles it once the model is built
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    config_path, overrides = parse_args(argv)
    try:
        cfg = load_config(PretrainConfig, config_path, overrides)
        from titan_core.config.pretrain import check_layout

        check_layout(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        check_startup(cfg)  # folders and data, before any process group or model
        # one job per run.dir: rank 0 holds its lock for the whole job, or exits 2 here
        with lock_for_rank(cfg.run.dir, int(os.environ.get("RANK", "0"))):
            if launched_by_torchrun():
                watch_launcher()  # a worker whose torchrun agent is killed stops, saved
            return run(cfg)
    except ConfigError as e:  # run() reports its own; these are from before it started
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


def run(cfg: PretrainConfig) -> int:
    """Train with a validated config; returns the process exit code."""
    warnings.filterwarnings("ignore", module="megatron")
    from titan_core.accelerator import get_accelerator
    from titan_core.accelerator.megatron_compat import import_megatron

    import_megatron(get_accelerator())  # first, as the device runs it (on CPU, uncompiled)
    from titan_core.checkpoint import CheckpointError
    from titan_core.parallel import peer_watch
    from titan_core.parallel.initialize import initialize, shutdown
    from titan_core.parallel.nodes import (
        claim_report,
        describe_nodes,
        lost_message,
        lost_peer,
        node_count,
    )
    from titan_core.signals import StopSignals, exit_code
    from titan_core.training.loop import Trainer

    startup_gc.imported()  # torch's and megatron-core's objects; settle() collects the build's
    signals = StopSignals()
    try:
        signals.install()  # SIGTERM / SIGINT: stop after the current step, saved
        signals.hint = _last_checkpoint(cfg)  # what a second signal's stop at once says
        accel, env, dp = initialize(cfg)
        peer_watch.set_hint(lambda: _last_checkpoint(cfg))
        if env.rank == 0:
            p = cfg.parallel
            print(
                f"titan pretrain: {accel.name}, world {env.world_size} = "
                f"TP{p.tensor_model_parallel_size} x PP{p.pipeline_model_parallel_size}"
                f"{f' (VPP{p.virtual_pipeline_model_parallel_size})' if p.virtual_pipeline_model_parallel_size else ''}"
                f" x DP{dp}"
                f"{f', EP{p.expert_model_parallel_size}' if p.expert_model_parallel_size > 1 else ''}"
                f"; run dir {cfg.run.dir}",
                flush=True,
            )
            if node_count() > 1:
                print(f"titan pretrain: {node_count()} nodes: {describe_nodes()}", flush=True)
        trainer = Trainer(cfg, accel, dp)
        startup_gc.settle()  # the imports' and the model's objects out of the steps' collections
        trainer.train(signals)
        peer_watch.leave()  # finished or stopped, saved: the other nodes end too, no alarm
        if trainer.stopped_by is not None:
            return exit_code(trainer.stopped_by)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except CheckpointError as e:  # damaged files to restore, a full disk: no traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CHECKPOINT_ERROR
    except Exception as e:  # a peer's process or node gone: who, and how to go on
        lost = lost_peer(e)
        if lost is None:
            raise
        # a node's first rank: its peer watch names the lost node better than a connection's
        # address does (a connection may come from another address of the node)
        lost = peer_watch.lost_node(timeout_s=2.0) or lost
        if claim_report():
            rank = int(os.environ.get("RANK", "0"))
            print(lost_message(rank, lost, _last_checkpoint(cfg)), file=sys.stderr, flush=True)
        return EXIT_LOST_PEER
    finally:
        shutdown()
        signals.restore()
    return 0


def _last_checkpoint(cfg: PretrainConfig) -> str:
    """Where a rerun resumes from, in words."""
    from pathlib import Path

    from titan_core.checkpoint import latest_iteration
    from titan_core.checkpoint.dist import iteration_dir

    root = Path(cfg.checkpoint.save or Path(cfg.run.dir) / "checkpoints")
    last = latest_iteration(root)
    if last is None:
        return "no checkpoint yet; rerun the same command to start over"
    return f"rerun the same command to resume from {iteration_dir(root, last)}"


if __name__ == "__main__":
    from titan_core.process_exit import exit_process

    exit_process(main())
