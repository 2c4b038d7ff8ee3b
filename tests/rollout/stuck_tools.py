"""Tool functions that never return, for the stuck-tool tests (module-level: a tool with
isolation="process" imports its function by name in a worker process)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

#: set by a test to let the blocked calls of :func:`blocks_until_released` return
RELEASE = threading.Event()


def never_returns(args: str) -> str:
    """A sync tool stuck for good (a remote call without a timeout, a lock never freed)."""
    threading.Event().wait()
    return "never"


def blocks_until_released(args: str) -> str:
    RELEASE.wait()
    return f"released {args}"


def echo(args: str) -> str:
    return args.upper()


def spins(args: str) -> str:
    """Writes its worker's pid to the file ``args`` names, then spins in pure Python for good
    (model-written code in a sandbox: ``while True: pass``)."""
    Path(args).write_text(str(os.getpid()))
    while True:
        pass


async def blocks_in_async_def(args: str) -> str:
    """An ``async def`` that blocks its event loop (a sync call inside it), for good."""
    Path(args).write_text(str(os.getpid()))
    threading.Event().wait()
    return "never"
