"""Wall time of a GRPO step and of its named phases, as the ``time/*`` metrics report them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil


class StepTimer:
    """``time/<phase>`` for each phase timed in a step, and ``time/step``.

    A step's time runs from the end of the previous step's measures (the first step: from its
    ``start``), so the previous step's metrics, status line and checkpoint count in it: the
    steps' times add up to the job's wall time, bar the final step's logging and save.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._last_end: float | None = None
        self._begin: float | None = None
        self._phases: dict[str, float] = {}

    def start(self) -> None:
        """Open a step (its phases so far are dropped)."""
        self._phases = {}
        self._begin = self._clock() if self._last_end is None else self._last_end

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``time/<name>`` (added up if a step times ``name`` twice)."""
        if self._begin is None:
            raise RuntimeError("StepTimer.start() before timing a phase")
        t = self._clock()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + self._clock() - t

    def stop(self) -> dict[str, float]:
        """Close the step: its phases in the order they were first timed, then ``time/step``."""
        if self._begin is None:
            raise RuntimeError("StepTimer.start() before stop()")
        end = self._clock()
        out = {f"time/{name}": seconds for name, seconds in self._phases.items()}
        out["time/step"] = end - self._begin
        self._last_end, self._begin, self._phases = end, None, {}
        return out


class StartupTimer:
    """The job's start-up, from the process's start to its first step, phase by phase.

    Phases that run side by side (the trainers building while the engines start) are timed
    as the driver waits for each: ``ended(name)`` marks a phase done at the time it returns.
    """

    def __init__(self) -> None:
        self._origin = psutil.Process().create_time()
        self._last = time.time()
        self.phases: dict[str, float] = {"imports": self._last - self._origin}

    def ended(self, name: str) -> None:
        """Phase ``name`` ran from the previous mark until now."""
        now = time.time()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self._origin

    def metrics(self) -> dict[str, float]:
        """``time/startup`` and ``time/startup/<phase>``, in the first step's record."""
        out = {f"time/startup/{k}": v for k, v in self.phases.items()}
        out["time/startup"] = self.total
        return out

    def line(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.phases.items())
        return f"start-up {self.total:.1f} s ({parts})"
