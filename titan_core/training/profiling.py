"""PyTorch profiler traces of chosen steps (``profile.steps``), one file per rank.

Traces land in ``<run.dir>/traces/rank{R}.step{S}.json`` and are what
``python -m titan_core.trace analyze`` reads; microbatch forwards carry
``titan/microbatch/{fwd|bwd}/mb{M}/vs{V}`` ranges (see ``annotate.py``), so pipeline
analysis needs no guessing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from titan_core.config.pretrain import PretrainConfig


class StepProfiler:
    def __init__(self, cfg: PretrainConfig, rank: int, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self.steps = set(cfg.profile.steps)
        self.dir = Path(cfg.profile.dir or Path(cfg.run.dir) / "traces")
        self.rank = rank
        self.with_stack = cfg.profile.with_stack

    def active(self, step: int) -> bool:
        return step in self.steps

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.dir.mkdir(parents=True, exist_ok=True)
        with (
            torch.profiler.profile(activities=activities, with_stack=self.with_stack) as prof,
            torch.profiler.record_function(f"ProfilerStep#{step}"),
        ):
            yield
        prof.export_chrome_trace(str(self.dir / f"rank{self.rank}.step{step}.json"))

    def close(self) -> None:
        pass
