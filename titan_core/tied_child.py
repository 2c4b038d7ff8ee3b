"""Children that die with the *process* that started them, whichever thread starts them.

A server a job starts (a rollout engine, the router, an engine's TP workers) must not outlive
the job: a ``kill -9`` of its parent (the Ray actor holding an engine, the driver holding the
router) would otherwise leave it serving on, re-parented to pid 1, holding its port and its
memory (~0.5 GB for the built-in engine, a GPU's worth for SGLang). Such a server runs in its
own process group (so that stopping it stops what it spawned), so no signal sent to its
parent's group reaches it either.

Linux has ``PR_SET_PDEATHSIG``: the child gets a signal when its parent dies. But the kernel
sends it when the parent *thread* that forked the child exits, not the parent process; a Ray
actor runs its methods on threads of Ray's, and an engine's supervisor restarts a dead server
from its watch thread. So :func:`popen_tied` forks every child from one thread that lives as
long as the process (started on first use), and the signal comes when the process dies.

The signal is SIGKILL by default: a parent that is gone has nobody left to serve, and only
SIGKILL also ends a child that is stopped (SIGSTOP) or stuck in its shutdown. Off Linux there
is no such call, and the child is started plainly.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from titan_core.child_process import die_with

_lock = threading.Lock()
#: the spawner thread's work: (what to run, where its result goes); None until first use
_jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] | None = None


def popen_tied(
    cmd: list[str], signum: int = signal.SIGKILL, **popen_kwargs: Any
) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` whose child gets ``signum`` when this process
    dies, however it dies (see the module doc); safe to call from any thread."""
    if "preexec_fn" in popen_kwargs:
        raise TypeError("popen_tied sets preexec_fn itself")
    preexec = die_with(os.getpid(), signum)
    if preexec is None:  # not Linux
        return subprocess.Popen(cmd, **popen_kwargs)
    done: Future[subprocess.Popen] = Future()
    _spawner().put((lambda: subprocess.Popen(cmd, preexec_fn=preexec, **popen_kwargs), done))
    return done.result()


def _spawner() -> queue.SimpleQueue[tuple[Callable[[], Any], Future]]:
    global _jobs
    with _lock:
        if _jobs is None:
            jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name="titan-spawner", daemon=True).start()
            _jobs = jobs
        return _jobs


def _serve(jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]]) -> None:
    """Run the forks, forever (the thread's exit would signal every child it started)."""
    while True:
        fn, done = jobs.get()
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(fn())
        except BaseException as e:  # the caller's error, raised in the caller
            done.set_exception(e)


def _forget_spawner() -> None:
    """A forked copy of this process has no spawner thread: it starts its own."""
    global _jobs, _lock
    _jobs, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_spawner)

__all__ = ["popen_tied"]
