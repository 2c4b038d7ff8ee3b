"""How the GRPO job stops on SIGTERM / SIGINT (:mod:`titan_core.signals`).

The first signal cancels the rollout or evaluation in flight; a step whose policy update has
begun is finished. The job then saves its last completed step (``run.save_on_signal``),
stops engines and trainer ranks, shuts Ray down and exits 128 + signum with one line saying
how to go on. A second signal kills every process of the job at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from titan_core.checkpoint.dist import iteration_dir
from titan_core.signals import StopSignals, signal_name


def until_stopped(
    aio: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], stop: StopSignals
) -> Any:
    """``aio.run_until_complete(coro)``, cancelled by a stop signal (then None, once the
    tasks it started are cancelled too: a rollout's requests, its reward calls)."""
    before = asyncio.all_tasks(aio)
    task = aio.create_task(coro)
    unregister = stop.on_request(lambda _: aio.call_soon_threadsafe(task.cancel))
    try:
        return aio.run_until_complete(task)
    except asyncio.CancelledError:
        if stop.requested is None:
            raise
        started = asyncio.all_tasks(aio) - before
        for t in started:
            t.cancel()
        if started:  # gather() of nothing would make its future on another event loop
            aio.run_until_complete(asyncio.gather(*started, return_exceptions=True))
        return None
    finally:
        unregister()


def stopped_line(
    signum: int,
    completed: int,
    start: int,
    saved: int | None,
    root: Path,
    save_on_signal: bool,
) -> str:
    """The one line a stopped job ends with: where it stopped, what it saved, how to go on.

    ``completed``: the last step whose policy update finished (``start`` if none did in this
    run); ``saved``: the newest checkpoint's step, if any."""
    where = f"at step {completed}" if completed > start else f"before step {start + 1} completed"
    if saved is not None and saved == completed:
        state, action = f"saved {iteration_dir(root, saved).name}", "resume"
    else:
        state = "not saved (run.save_on_signal=false)" if not save_on_signal else "nothing to save"
        if saved is not None:
            state += f", last checkpoint {iteration_dir(root, saved)}"
        action = "resume from it" if saved is not None else "start over"
    return f"stopped by {signal_name(signum)} {where}; {state}; rerun the same command to {action}"


def lost_line(error: Exception, completed: int, start: int, saved: int | None, root: Path) -> str:
    """The one line a job whose engines were lost for good ends with: what was lost, where the
    run stands, how to go on."""
    where = f"at step {completed}" if completed > start else f"before step {start + 1} completed"
    if saved is not None:
        state = f"last checkpoint {iteration_dir(root, saved)}"
        action = "resume from it"
    else:
        state, action = "nothing saved", "start over"
    return (
        f"stopped {where}: engines lost for good ({error}); {state}; rerun the same command "
        f"to {action} once engines can start again (the node back, or ray.engine_resources "
        "naming nodes that are up)"
    )
