"""One job per run directory: an exclusive ``flock`` on ``<run.dir>/.titan.lock``.

A second job started on a run directory in use (a restart while the first still trains,
two users picking the same folder) would write the same checkpoints and metrics; it stops at
start-up instead, with a :class:`RunDirLockedError` naming the holder's pid and host.

The kernel holds the lock for the open file, so it goes when the holder's process ends, however
it ends: a ``kill -9`` leaves no stale lock, and a lock file left behind is simply taken over.
A process forked from the holder shares its lock until it exits too (what is still running
may still write). The file records the holder (pid, host, start time, command) as JSON, for
the message a second job prints; it is written after the lock is taken and emptied before it
is released. On a shared file system flock reaches the other nodes where the mount supports it
(NFSv4, Lustre mounted with ``-o flock``); where it cannot lock at all, the job warns and runs
unguarded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from titan_core.config import ConfigError

LOCK_NAME = ".titan.lock"


class RunDirLockedError(ConfigError):
    """Another live job holds the run directory's lock."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory: what its lock file records."""

    pid: int
    host: str
    started: str
    command: str

    @classmethod
    def of_this_process(cls) -> Holder:
        return cls(
            pid=os.getpid(),
            host=socket.gethostname(),
            started=time.strftime("%Y-%m-%d %H:%M:%S %z"),
            command=shlex.join(getattr(sys, "orig_argv", sys.argv)),
        )


def read_holder(path: str | Path, wait_s: float = 1.0) -> Holder | None:
    """The holder recorded in lock file ``path``; None when it records none. Waits up to
    ``wait_s`` for a holder that has just taken the lock to finish writing its record."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Holder(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


class RunLock:
    """The exclusive lock on ``run_dir`` (a context manager; created if missing).

    ``key`` names the setting that chose the folder, for the error message.
    """

    def __init__(self, run_dir: str | Path, key: str = "run.dir") -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.key = key
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunDirLockedError`, at once (never waits)."""
        if self._file is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # no O_TRUNC: the holder's record must survive a second job's open
            f = open(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+")  # noqa: SIM115
        except OSError as e:
            raise ConfigError(
                f"{self.key} {self.run_dir} is not a writable folder ({e.strerror or e}); "
                f"choose another {self.key}"
            ) from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise self._locked_error() from None
        except OSError as e:  # a file system without locks: run, but say it is unguarded
            f.close()
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            print(
                f"warning: cannot lock {self.key} {self.run_dir} ({e.strerror}); a second job "
                "started on it will not be stopped",
                file=sys.stderr,
                flush=True,
            )
            return
        f.truncate(0)
        f.write(json.dumps(asdict(Holder.of_this_process())) + "\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        f, self._file = self._file, None
        if f is None:
            return
        with contextlib.suppress(OSError):
            f.truncate(0)  # before unlocking: afterwards the file may be the next holder's
        f.close()  # closing the last descriptor of the open file releases the flock

    def _locked_error(self) -> RunDirLockedError:
        holder = read_holder(self.path)
        if holder is None:
            who = "another process (its lock file records no holder)"
        else:
            command = textwrap.shorten(holder.command, 200, placeholder=" ...")  # one line
            who = f"pid {holder.pid} on host {holder.host} (started {holder.started}: {command})"
        return RunDirLockedError(
            f"{self.key} {self.run_dir} is in use by {who}; two jobs in one {self.key} would "
            f"write the same checkpoints: stop that job and rerun, or choose another {self.key}"
        )

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_for_rank(run_dir: str | Path, rank: int) -> contextlib.AbstractContextManager:
    """The run directory's lock for global ``rank`` of a job: rank 0 takes it, for the whole
    job (the other ranks, on this node or others, share its folder); a no-op elsewhere."""
    return RunLock(run_dir) if rank == 0 else contextlib.nullcontext()
