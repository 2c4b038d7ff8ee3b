"""Workers stop when their launcher dies.

torchrun's agent supervises its workers: it stops them all when one fails or when it gets
a signal. A ``kill -9`` of the agent (an OOM kill, a node agent gone wrong) leaves them
running on unsupervised, into a ``run.dir`` a restarted job will use too. So a worker
started by a launcher watches it: a daemon thread polls the parent pid (the worker is
re-parented when its launcher dies), and when it changed sends this process SIGTERM, the
stop path of :mod:`titan_core.signals` (the current step finished, saved, exit 143). If the
process is still running ``grace_s`` later (a collective waiting on a peer that is gone), it
exits at once, its descendants killed.

A parent pid poll rather than ``PR_SET_PDEATHSIG``: the kernel sends that signal when the
parent *thread* that forked the worker exits, not the parent process, and it only exists on
Linux.

The other way round, children the worker's main thread forks (megatron's checkpoint writer,
data workers) do get ``PR_SET_PDEATHSIG`` (SIGKILL, on Linux): a worker killed outright (the
OOM killer) would otherwise leave them behind holding its sockets open, so that the ranks on
other nodes never see its connections close and wait in their collectives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping

from titan_core.child_process import die_with
from titan_core.signals import exit_code, kill_descendants

#: how often the parent pid is checked, in seconds
POLL_S = 1.0
#: how long the stop path gets before the process exits at once: what torchrun itself gives
#: its workers between its SIGTERM and its SIGKILL
GRACE_S = 30.0


def launched_by_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    """This process is a worker of torchrun (or a launcher that sets ``LOCAL_RANK``)."""
    return "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env


def watch_launcher(poll_s: float = POLL_S, grace_s: float = GRACE_S) -> threading.Thread:
    """Start watching this process's parent, and tie what the main thread forks to this
    process (see the module doc); returns the daemon thread."""
    tie_forks()
    parent = os.getppid()
    thread = threading.Thread(
        target=_watch, args=(parent, poll_s, grace_s), name="titan-launcher-watch", daemon=True
    )
    thread.start()
    return thread


#: what the child about to be forked runs first (None: forked from another thread)
_IN_CHILD: list[Callable[[], None] | None] = [None]
_TIED: list[bool] = []


def tie_forks() -> None:
    """Children forked (``os.fork``, multiprocessing's fork) by the main thread of this process
    from now on get SIGKILL when it dies; once per process, Linux only."""
    if _TIED or not hasattr(os, "register_at_fork") or die_with(0) is None:
        return
    _TIED.append(True)

    def before() -> None:  # in the parent, so the child only calls prctl
        main = threading.current_thread() is threading.main_thread()
        # a thread that ends early would take the child along: only the main thread's
        _IN_CHILD[0] = die_with(os.getpid(), signal.SIGKILL) if main else None

    def in_child() -> None:
        if _IN_CHILD[0] is not None:
            _IN_CHILD[0]()

    os.register_at_fork(before=before, after_in_child=in_child)


def _watch(parent: int, poll_s: float, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _say(
        f"titan: the launcher (pid {parent}) of this worker (pid {os.getpid()}) is gone: "
        "stopping after the current step"
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    _say(f"titan: worker (pid {os.getpid()}) still running {grace_s:g} s after its launcher died: "
         "exiting now")  # fmt: skip
    kill_descendants()
    os._exit(exit_code(signal.SIGTERM))


def _say(text: str) -> None:
    """One line on stderr through its descriptor (the main thread may be inside a print)."""
    with contextlib.suppress(OSError):
        os.write(2, f"{text}\n".encode())
