"""``record_function`` ranges per microbatch forward and backward, for exact trace analysis.

Names follow ``titan_core.trace``'s convention: ``titan/microbatch/{fwd|bwd}/mb{M}/vs{V}``.
The forward range wraps the chunk's forward call. megatron-core's schedules run the
backward themselves, so the backward range is opened and closed from autograd: an identity
function on the chunk's output opens it when the gradient arrives (the first thing that
microbatch's backward does), and one on the decoder's input closes it (the last thing).
Only active on profiled steps; otherwise the forward step is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_OPEN: list[Any] = []


class _OpenBackwardRange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        # A copy, not a view: the pipeline schedules free stage outputs and refuse views.
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rf = torch.autograd.profiler.record_function(ctx.name)
        rf.__enter__()
        _OPEN.append(rf)
        return grad, None


class _CloseBackwardRange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _OPEN:
            _OPEN.pop().__exit__(None, None, None)
        return grad


class MicrobatchAnnotator:
    """Counts microbatches per virtual stage within a step and names their ranges."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.active = False
        self._count: dict[int, int] = {}
        for chunk in chunks:
            decoder = getattr(chunk, "decoder", None)
            if decoder is not None:
                decoder.register_forward_pre_hook(self._close_on_input, with_kwargs=True)

    def _close_on_input(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.active:
            return args, kwargs
        if "hidden_states" in kwargs and torch.is_tensor(kwargs["hidden_states"]):
            hs = kwargs["hidden_states"]
            if hs.requires_grad:
                kwargs = {**kwargs, "hidden_states": _CloseBackwardRange.apply(hs)}
        elif args and torch.is_tensor(args[0]) and args[0].requires_grad:
            args = (_CloseBackwardRange.apply(args[0]), *args[1:])
        return args, kwargs

    @contextlib.contextmanager
    def step(self, active: bool) -> Iterator[None]:
        self.active, self._count = active, {}
        try:
            yield
        finally:
            self.active = False
            while _OPEN:  # a backward that never reached the input (e.g. frozen layers)
                _OPEN.pop().__exit__(None, None, None)

    @contextlib.contextmanager
    def forward(self, vs: int) -> Iterator[str]:
        """Wraps one microbatch forward; yields the backward range name for ``wrap_output``."""
        if not self.active:
            yield ""
            return
        mb = self._count.get(vs, 0)
        self._count[vs] = mb + 1
        with torch.profiler.record_function(f"titan/microbatch/fwd/mb{mb}/vs{vs}"):
            yield f"titan/microbatch/bwd/mb{mb}/vs{vs}"

    def wrap_output(self, output: torch.Tensor, bwd_name: str) -> torch.Tensor:
        if not bwd_name or not output.requires_grad:
            return output
        return _OpenBackwardRange.apply(output, bwd_name)
