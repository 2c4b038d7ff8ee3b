"""The main job's services around a slime / miles driver's loop, the same implementations
``python -m titan_rl.grpo`` runs on: one job per run folder (``titan_core.run_lock``), and
SIGTERM / SIGINT stopping the run at a rollout boundary with the last completed rollout saved
(``titan_core.signals``).

The first signal abandons a rollout or evaluation in flight (the rollout manager, busy with
it, is killed; its engines go with it); a rollout whose training has begun is finished. The
last completed rollout is then saved, unless ``run.save_on_signal`` is false, Ray is shut
down, and the job exits 128 + signum with one line saying how to go on. A second signal
stops everything at once.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_core.run_lock import RunLock
from titan_core.signals import StopSignals, ignoring

#: how often a wait on the rollout manager looks at the stop request (seconds)
POLL_S = 0.5


@contextlib.contextmanager
def job_services(run_dir: Path, save_dir: str | None) -> Iterator[StopSignals]:
    """The run folder (and ``--save``, where it lies elsewhere) locked for this job, and
    the stop signals' handlers installed: the one ``StopSignals`` the loop reads."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(RunLock(run_dir, key="run.dir"))
        if save_dir and Path(save_dir).resolve() != Path(run_dir).resolve():
            stack.enter_context(RunLock(save_dir, key="--save"))
        yield stack.enter_context(StopSignals())


def ray_init_under(stop: StopSignals, init: Any) -> None:
    """``init()`` (a local Ray's start) with SIGINT ignored by the processes it starts (a
    Ctrl-C reaching the process group is this job's to handle), then this job's handlers
    back (``ray.init`` installs its own SIGTERM handler)."""
    with ignoring(signal.SIGINT):
        init()
    stop.install()


def wait_or_stop(ref: Any, stop: StopSignals) -> tuple[bool, Any]:
    """``(True, ray.get(ref))``, or ``(False, None)`` once a stop signal came first."""
    import ray

    while True:
        ready, _ = ray.wait([ref], timeout=POLL_S)
        if ready:
            return True, ray.get(ready[0])
        if stop.requested is not None:
            return False, None


async def await_or_stop(ref: Any, stop: StopSignals) -> tuple[bool, Any]:
    """:func:`wait_or_stop` for a driver on an event loop."""
    import asyncio

    task = asyncio.ensure_future(ref)
    while True:
        done, _ = await asyncio.wait({task}, timeout=POLL_S)
        if done:
            return True, task.result()
        if stop.requested is not None:
            task.cancel()
            return False, None


@dataclass
class RolloutProgress:
    """Where a framework loop stands: what a stop signal saves and reports."""

    start: int  #: the first rollout id this run runs (after a resume: the checkpoint's + 1)
    completed: int | None = None  #: the last rollout id whose training finished
    saved: int | None = None  #: the newest checkpoint's rollout id

    def needs_save(self, save_on_signal: bool) -> bool:
        return save_on_signal and self.completed is not None and self.saved != self.completed


def stopped_line(stop: StopSignals, p: RolloutProgress, save_dir: str, save_on_signal: bool) -> str:
    """The one line a stopped driver ends with: where, what it saved, how to go on."""
    where = (
        f"after rollout {p.completed}"
        if p.completed is not None
        else f"before rollout {p.start} completed"
    )
    if p.saved is not None and p.saved == p.completed:
        state, action = f"saved rollout {p.saved} in {save_dir}", "resume from it"
    elif p.completed is not None and not save_on_signal:
        state, action = "not saved (run.save_on_signal=false)", "resume from the last checkpoint"
    elif p.saved is not None:
        state, action = f"last checkpoint: rollout {p.saved} in {save_dir}", "resume from it"
    else:
        state, action = "nothing to save", "start over"
    return f"stopped by {stop.name} {where}; {state}; rerun the same command to {action}"


def stop_manager(manager: Any) -> None:
    """A rollout manager busy with an abandoned rollout: killed (the engine actors it owns
    go with it, and their servers with them)."""
    import ray

    ray.kill(manager, no_restart=True)
