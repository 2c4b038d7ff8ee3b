"""PyTorch profiler traces of chosen steps (``profile.steps``), one file per rank.

The profiler runs from the first to the last listed step and writes
``<run.dir>/traces/rank{R}.json`` with a ``ProfilerStep#N`` range per step; microbatch
forwards and backwards carry ``titan/microbatch/{fwd|bwd}/mb{M}/vs{V}`` ranges and the
schedule a ``titan/schedule`` range (see ``annotate.py``), so
``python -m titan_core.trace analyze <run.dir>/traces`` needs no guessing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from titan_core.config.pretrain import ProfileConfig


class StepProfiler:
    """Profiles ``profile.steps`` of a run (pretraining or RL) on one rank."""

    def __init__(
        self,
        profile: ProfileConfig,
        run_dir: str | Path,
        rank: int,
        activities: Iterable[torch.profiler.ProfilerActivity] = (
            torch.profiler.ProfilerActivity.CPU,
        ),
    ) -> None:
        #: what the profiler records (the accelerator's ``profiler_activities()``)
        self.activities = list(activities)
        steps = sorted(profile.steps)
        self.first, self.last = (steps[0], steps[-1]) if steps else (0, -1)
        self.dir = Path(profile.dir or Path(run_dir) / "traces")
        self.rank = rank
        self.with_stack = profile.with_stack
        self._prof: torch.profiler.profile | None = None

    def active(self, step: int) -> bool:
        return self.first <= step <= self.last

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if not self.active(step):
            yield
            return
        if self._prof is None:
            self._prof = torch.profiler.profile(
                activities=self.activities, with_stack=self.with_stack
            )
            self._prof.__enter__()
        with torch.profiler.record_function(f"ProfilerStep#{step}"):
            yield
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when a run ends inside the profiled window)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.dir / f"rank{self.rank}.json"))
