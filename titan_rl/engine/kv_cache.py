"""The running batch's KV cache: HF's DynamicCache with layers that grow in place.

HF's ``DynamicLayer`` appends each decode step's keys and values with ``torch.cat``, copying
the whole cache every step: at 64 sequences of ~1,000 tokens that copy was a sixth of the
CPU engine's time. :class:`GrowingLayer` keeps its keys and values as views of buffers with
spare room on the sequence axis and writes a step's token into that room; a buffer is
copied only when it is full (then with a quarter more room) or when the runner replaced the
layer's tensors (a prefill merged in, rows dropped). A prompt prefilled in chunks writes each
chunk into a buffer sized for the whole prompt at its first chunk (``reserve``), so carrying
its partial cache from chunk to chunk copies nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: the least spare room a grown buffer gets (tokens), and its share of the length
MIN_SPARE = 64
SPARE_SHARE = 0.25


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` ([B, heads, T, head_dim]) are views of
    larger buffers; anything may still assign them new tensors (they are adopted)."""

    def __init__(self, reserve: int = 0) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        #: tokens the first update's buffers hold room for (a chunked prompt's whole length)
        self.reserve = reserve

    def _in_buffer(self) -> bool:
        """Whether ``keys`` / ``values`` are still the leading views of this layer's buffers."""
        kbuf, vbuf = self._kbuf, self._vbuf
        return (
            kbuf is not None
            and vbuf is not None
            and self.keys.data_ptr() == kbuf.data_ptr()
            and self.values.data_ptr() == vbuf.data_ptr()
            and self.keys.shape[:2] == kbuf.shape[:2]
            and self.values.shape[:2] == vbuf.shape[:2]
        )

    @staticmethod
    def _grown(t: torch.Tensor, need: int, reserve: int = 0) -> torch.Tensor:
        room = reserve if need <= reserve else need + max(MIN_SPARE, int(need * SPARE_SHARE))
        buf = t.new_empty(t.shape[0], t.shape[1], room, t.shape[3])
        buf[:, :, : t.shape[2]] = t
        return buf

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.keys.numel() == 0:
            if self.reserve <= key_states.shape[2]:
                return super().update(key_states, value_states, *args, **kwargs)
            # the first chunk of a longer prompt: buffers with room for all of it, below
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
            self._kbuf = self._vbuf = None
        t, n = self.keys.shape[2], key_states.shape[2]
        need = t + n
        if not self._in_buffer() or self._kbuf.shape[2] < need or self._vbuf.shape[2] < need:
            self._kbuf = self._grown(self.keys, need, self.reserve)
            self._vbuf = self._grown(self.values, need, self.reserve)
        self._kbuf[:, :, t:need] = key_states
        self._vbuf[:, :, t:need] = value_states
        self.keys = self._kbuf[:, :, :need]
        self.values = self._vbuf[:, :, :need]
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


def new_cache(config: Any, reserve: int = 0) -> DynamicCache:
    """A DynamicCache for ``config``'s model, its full-attention layers :class:`GrowingLayer`
    s (any other kind HF picks for a layer is kept); ``reserve``: tokens the first update's
    buffers hold room for (a prompt prefilled in chunks: its whole length)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(reserve) if type(x) is DynamicLayer else x for x in cache.layers]
    return cache


__all__ = ["GrowingLayer", "new_cache"]
