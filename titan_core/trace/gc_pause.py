"""The cyclic garbage collector paused around parsing and analysis."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic GC off for a stretch of parsing or analysis: it allocates hundreds of
    thousands of objects and frees them by reference counting (no cycles), so the GC
    would only rescan the growing columns over and over. Nests; restores the old state."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
