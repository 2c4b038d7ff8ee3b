"""Work in a forked child process whose bytes come back through a pipe.

For the analyzer's own parallelism on one machine: a fork needs no interpreter start and
no imports (multiprocessing's import alone costs more than a small trace's parse). Linux
only, where fork is the safe default.
"""

from __future__ import annotations

import os
from collections.abc import Callable


class Forked:
    """``work()`` running in a forked child; :meth:`result` is the bytes it returned."""

    def __init__(self, work: Callable[[], bytes]) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.close(r)
                data = work()
                with open(w, "wb") as out:
                    out.write(data)
            except BaseException:  # the parent reads a short or empty result
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        self.pid = pid
        self._read = r

    def result(self) -> bytes:
        """Everything the child wrote; empty if it died before writing."""
        with open(self._read, "rb", closefd=False) as fh:
            return fh.read()

    def close(self) -> None:
        """Reap the child (one still writing gets a broken pipe and exits)."""
        os.close(self._read)
        os.waitpid(self.pid, 0)
