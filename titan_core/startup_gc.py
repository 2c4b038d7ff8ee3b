"""Python's cyclic garbage collector around a process's start-up.

A start-up (torch, transformers, megatron-core and Ray imported; a model built) allocates a
few hundred thousand objects that live as long as the process. While they accumulate, the
collector scans them again and again: ~20% of the import time of torch + transformers +
megatron-core here (6.0 CPU-s with the collector on, 4.3-5.0 off). Once started, the process
would still scan them in every full collection of its steps, and once more at exit (~1 s for
the GRPO driver, where the job had ended).

:func:`paused` turns the collector off for the start-up; :func:`imported` moves what the
imports made into the permanent generation (``gc.freeze``: no later collection scans it)
without collecting it; :func:`settle` then collects once what came after (the model's build
and load: its garbage caught in cycles is freed, not kept), freezes what is left and turns
the collector back on. Objects made after that are collected as usual.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """The collector off in the block until :func:`settle` is called in it; on at the
    block's end either way (a start-up that failed before settling leaves it on)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def pause() -> None:
    """The collector off until :func:`settle`, for a process that settles in another call
    than the one that starts it (a Ray actor's constructor, then its set-up)."""
    gc.disable()


def imported() -> None:
    """The start-up's imports are done (the collector stays off): what they made moves into
    the permanent generation uncollected, so :func:`settle`'s collection scans only what came
    after. The imports' own garbage caught in cycles stays with the process: 12k of the 825k
    objects torch, transformers, megatron-core, FastAPI and Ray leave, where collecting them
    all costs ~0.5 CPU-s, at the busiest moment of a GRPO job's start (its trainer, engine
    and driver start on the same cores). No model or data is loaded by then."""
    gc.freeze()


def settle() -> float:
    """End of start-up: one collection, what lives moved out of later collections' reach,
    the collector back on. Returns the seconds it took."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.enable()
    return time.perf_counter() - t
