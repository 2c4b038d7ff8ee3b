"""Preemption: a training job stops at a step boundary on SIGTERM or SIGINT.

SLURM and Kubernetes send SIGTERM a while before they kill a job; Ctrl-C sends SIGINT.
:class:`StopSignals` turns the first of them into a request the training loop reads
between steps (it finishes or abandons the current step, saves the last completed one and
shuts down), and a second into an immediate stop: every descendant process is killed and
the job exits at once. Either way the exit status is ``128 + signum`` (143 for SIGTERM,
130 for SIGINT), as shells and schedulers expect of a process a signal stopped.

The second signal does not raise into the main thread (as KeyboardInterrupt does): raised
inside a C extension's call (``ray.get``), an exception can come out as a SystemError.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: the installed instances, innermost last (what :func:`active` returns)
_ACTIVE: list[StopSignals] = []


def exit_code(signum: int) -> int:
    """The exit status of a job a signal stopped (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def active() -> StopSignals | None:
    """The innermost installed :class:`StopSignals` of this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


class Stopped(Exception):
    """A job (or a child job) that a stop signal ended; ``message``: the line to print."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class StopSignals:
    """SIGTERM / SIGINT handlers for a training loop (a context manager; main thread only,
    elsewhere it installs nothing and ``requested`` stays None).

    ``requested``: the first signal's number, read by the loop between steps. Callbacks
    given to :meth:`on_request` run on the first signal (forward it to a child, cancel a
    rollout). The second signal kills every descendant process (Ray's, a child job's) and
    exits with ``hint`` said on stderr. A library that installs its own handlers
    (``ray.init``) replaces ours: call :meth:`install` again after it. On exit the handlers
    from before the first install come back.
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.requested: int | None = None
        #: what a second signal's stop says after "the step in progress is lost"
        self.hint = "rerun the same command to resume from the last checkpoint"
        self._previous: dict[int, Any] = {}
        self._on_request: list[Callable[[int], None]] = []

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    @property
    def exit_code(self) -> int:
        assert self.requested is not None, "no stop signal came"
        return exit_code(self.requested)

    @property
    def name(self) -> str:
        assert self.requested is not None, "no stop signal came"
        return signal_name(self.requested)

    def install(self) -> None:
        """(Re)install the handlers; the first call remembers the ones to restore."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            previous = signal.signal(s, self._handle)
            if s not in self._previous and previous is not self._handle:
                self._previous[s] = previous
        if self not in _ACTIVE:
            _ACTIVE.append(self)

    def restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def on_request(self, fn: Callable[[int], None]) -> Callable[[], None]:
        """Call ``fn(signum)`` on the first signal (now, if it already came); returns a
        function that unregisters it."""
        self._on_request.append(fn)
        if self.requested is not None:
            fn(self.requested)
        return lambda: self._on_request.remove(fn) if fn in self._on_request else None

    def request(self, signum: int) -> None:
        """What the first signal does: ``requested`` set, the callbacks called."""
        if self.requested is None:
            self.requested = signum
            for fn in list(self._on_request):
                fn(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # stderr through its descriptor: the main thread may be inside a print right now
        if self.requested is None:
            _say(
                f"{signal_name(signum)} received: stopping after the current step "
                "(send it again to stop at once)"
            )
            self.request(signum)
            return
        _say(
            f"{signal_name(signum)} again: stopped at once, the step in progress is lost; {self.hint}"
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        kill_descendants()
        os._exit(exit_code(self.requested))


@contextlib.contextmanager
def ignoring(signum: int) -> Iterator[None]:
    """Ignore ``signum`` while the body starts processes: they inherit SIG_IGN, so a Ctrl-C
    that reaches the whole process group leaves them to this job's own shutdown."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"{text}\n".encode())


#: how long :func:`kill_descendants` waits for the killed processes to be gone
KILLED_WAIT_S = 5.0


def kill_descendants() -> None:
    """SIGKILL every process this one started, and theirs (Ray's node, its workers and
    their servers, a child job), and wait until each is gone: none may outlive a job
    stopped at once. A SIGKILL takes effect when its process is next scheduled, which a busy
    machine delays, so without the wait one could still be running when the job's exit
    status is seen (``psutil.wait_procs``: this process reaps its children, init the
    rest once their parents are dead)."""
    import psutil

    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for p in procs:  # parents before their children: a supervisor cannot restart one
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=KILLED_WAIT_S)
