"""The engine's growing KV layers against HF's DynamicLayer: the same keys and values at
every step, written in place between growths, and adopting tensors assigned from outside."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from titan_rl.engine.kv_cache import MIN_SPARE, GrowingLayer


def _kv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)


def test_growing_layer_equals_dynamic_layer_step_by_step() -> None:
    grow, ref = GrowingLayer(), DynamicLayer()
    ptrs = set()
    for step in range(3 * MIN_SPARE):
        k, v = _kv(3, 7 if step == 0 else 1, step)  # a prefill, then decode steps
        got, want = grow.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert grow.get_seq_length() == ref.get_seq_length() == 7 + step
        ptrs.add(grow.keys.data_ptr())
    # 3 x MIN_SPARE steps wrote in place: only a handful of buffers were ever allocated
    assert len(ptrs) <= 4


def test_tensors_assigned_from_outside_are_adopted() -> None:
    grow, ref = GrowingLayer(), DynamicLayer()
    for step in range(5):
        k, v = _kv(4, 1 + 4 * (step == 0), step)
        grow.update(k, v), ref.update(k, v)
    # the runner drops rows and leading padding columns (select_rows)
    for layer in (grow, ref):
        layer.keys = layer.keys[[0, 2], :, 2:]
        layer.values = layer.values[[0, 2], :, 2:]
    for step in range(5, 9):
        k, v = _kv(2, 1, step)
        got, want = grow.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a batch-dimension view of the buffer (same storage start, fewer rows) is adopted too
    grow.keys, grow.values = grow.keys[:1], grow.values[:1]
    ref.keys, ref.values = ref.keys[:1], ref.values[:1]
    k, v = _kv(1, 1, 99)
    got, want = grow.update(k, v), ref.update(k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    grow.reset()
    assert grow.get_seq_length() == 0


def test_reserved_layer_takes_a_prompt_in_chunks_without_copies() -> None:
    """A prompt prefilled in chunks into a layer reserved for its length: one buffer, the
    same keys and values as HF's layer; decode steps after it grow it as before."""
    grow, ref = GrowingLayer(reserve=50), DynamicLayer()
    ptrs = set()
    for step, n in enumerate((16, 16, 16, 2)):
        k, v = _kv(2, n, step)
        got, want = grow.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        ptrs.add(grow.keys.data_ptr())
    assert len(ptrs) == 1 and grow._kbuf.shape[2] == 50
    k, v = _kv(2, 1, 9)  # past the reserve: grown with spare room
    got, want = grow.update(k, v), ref.update(k, v)
    assert torch.equal(got[0], want[0]) and grow._kbuf.shape[2] >= 51 + MIN_SPARE
    # a whole prompt no longer than the reserve's first update is taken as HF's layer does
    small = GrowingLayer(reserve=4)
    k, v = _kv(1, 4, 10)
    assert torch.equal(small.update(k, v)[0], k)
