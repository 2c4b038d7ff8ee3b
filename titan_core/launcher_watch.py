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
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Mapping

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
    """Start watching this process's parent (see the module doc); returns the daemon thread."""
    parent = os.getppid()
    thread = threading.Thread(
        target=_watch, args=(parent, poll_s, grace_s), name="titan-launcher-watch", daemon=True
    )
    thread.start()
    return thread


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
