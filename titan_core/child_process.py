"""A child job (``python -m titan_core.pretrain ...``) that stops with its parent.

The child runs in its own process group, so a Ctrl-C meant for the parent's group reaches it
once, through the parent: the parent's stop signal (:mod:`titan_core.signals`) is forwarded
to it, and it stops as a job stops (the current step finished, saved, exit 128 + signum). A
second signal kills it. On Linux it also gets SIGTERM when the parent dies
(``PR_SET_PDEATHSIG``), so a ``kill -9`` of the parent leaves no orphan training on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from titan_core import signals

PR_SET_PDEATHSIG = 1


def die_with(parent: int, signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent ``signum`` when ``parent`` dies (Linux only;
    None elsewhere). The kernel sends it when the parent *thread* that forks the child exits:
    fork from a thread that lives as long as the process (the main thread here;
    :func:`titan_core.tied_child.popen_tied` from any thread)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signum)

    return preexec


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def stopped_by(returncode: int) -> int | None:
    """The stop signal a child's exit status says it stopped on (143 / 130, or killed by
    SIGTERM / SIGINT), else None."""
    for s in signals.STOP_SIGNALS:
        if returncode in (signals.exit_code(s), -s):
            return s
    return None


def run_child(cmd: list[str], **popen_kwargs: Any) -> int:
    """Run ``cmd`` to its end in its own process group; returns its exit status.

    While it runs, the first stop signal of this process's :class:`~titan_core.signals.
    StopSignals` is forwarded to it (a second one kills it, as every descendant).
    """
    stop = signals.active()
    proc = subprocess.Popen(cmd, process_group=0, preexec_fn=die_with(os.getpid()), **popen_kwargs)
    unregister = None
    if stop is not None:
        unregister = stop.on_request(lambda signum: _signal_group(proc, signum))
    try:
        return proc.wait()
    except BaseException:  # an interrupt, an error here: the child goes too
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        if unregister is not None:
            unregister()
