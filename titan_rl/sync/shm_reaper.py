"""Unlink this process's shared-memory tensors from /dev/shm once nothing maps them, even
after a ``kill -9``.

On CPU the tensor transport sends weights as torch shared memory (``file_system`` sharing:
named segments in /dev/shm). Torch frees a segment when the last process that maps it
closes it, or through its ``torch_shm_manager`` once the processes using it are gone. A
killed job does neither: Ray kills a worker's children when the worker exits, the manager
among them, so each ``kill -9`` of a GRPO driver left its sync buckets in /dev/shm until
reboot.

:func:`track` hands a segment's name to a reaper process, started once per process and
detached from it (not its child, so Ray leaves it alone). When the owner is gone (the pipe
between them closes), the reaper waits until no process maps a segment any more, then
unlinks it if it is still there. Unlinking only unmapped segments matters: torch aborts a
process whose last close finds its segment's name gone.

This file runs as a script (``python -S shm_reaper.py``): the reaper imports no torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SHM = Path("/dev/shm")
#: after the owner is gone, before the first look: a process may be between opening a
#: segment and mapping it (torch's own manager waits as long before it frees anything)
GRACE_S = 2.0
POLL_S = 1.0
#: a segment still mapped this long after its owner died is left to its last mapper
MAX_WAIT_S = 3600.0

_lock = threading.Lock()
#: (pid that started it, the reaper's launcher): the pipe to the reaper is its stdin
_reaper: tuple[int, subprocess.Popen] | None = None


def track(storage: torch.UntypedStorage) -> None:
    """Have ``storage``'s /dev/shm segment unlinked once this process and every process
    mapping it are gone (a no-op for other storages and off Linux)."""
    if not sys.platform.startswith("linux") or storage.device.type != "cpu":
        return
    if not storage.is_shared():
        return
    name = storage._share_filename_cpu_()[1].decode().lstrip("/")
    with _lock:
        pipe = _pipe()
        if pipe is None:
            return
        try:
            pipe.write(f"{name}\n".encode())
            pipe.flush()
        except OSError:  # the reaper is gone (killed): segments are left to torch
            pass


def _pipe() -> Any:
    global _reaper
    if _reaper is None or _reaper[0] != os.getpid():  # none yet, or a forked child's
        launcher = subprocess.Popen(
            [sys.executable, "-S", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        launcher.wait()  # it forks the reaper and exits at once
        if launcher.returncode != 0:
            return None
        _reaper = (os.getpid(), launcher)
    return _reaper[1].stdin


def mapped(names: set[str]) -> set[str]:
    """Those of ``names`` (files in /dev/shm) some process maps, by /proc/<pid>/maps."""
    found: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            with open(proc / "maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(None, 5)[5:]
                    if path and path[0].startswith("/dev/shm/"):
                        name = path[0][len("/dev/shm/") :].removesuffix(" (deleted)")
                        if name in names:
                            found.add(name)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def reap(names: set[str], max_wait_s: float = MAX_WAIT_S) -> None:
    """Unlink each of ``names`` that still exists once no process maps it."""
    deadline = time.monotonic() + max_wait_s
    while True:
        names = {n for n in names if (SHM / n).exists()}
        if not names:
            return
        busy = mapped(names)
        for n in names - busy:
            with contextlib.suppress(FileNotFoundError):
                (SHM / n).unlink()
        names = busy
        if not names or time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


def _main() -> None:
    if os.fork():  # detach: Ray kills a worker's children when it exits, not grandchildren
        os._exit(0)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a job's stop is not ours
        signal.signal(s, signal.SIG_IGN)
    names: set[str] = set()
    for line in sys.stdin.buffer:  # until the owner closes the pipe, or dies
        name = line.decode(errors="replace").strip()
        if name and "/" not in name:
            names.add(name)
    time.sleep(GRACE_S)
    reap(names)


if __name__ == "__main__":
    _main()
