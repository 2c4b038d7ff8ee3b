"""SavedActivationCounter on toy autograd graphs: the bytes autograd saves, counted by hand."""

from __future__ import annotations

import gc

import torch

from titan_core.training.saved_activations import SavedActivationCounter


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_counts_saved_tensors_and_releases_them_after_backward() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, 8, generator=gen, requires_grad=True)
    b = torch.randn(8, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    with SavedActivationCounter() as counter:
        c = a.double() @ b  # mm saves both operands: a.double() (new storage) and b
        d = c.sigmoid()  # sigmoid saves its output
        loss = d.sum()  # sum saves nothing
    expected = _nbytes(a.double()) + _nbytes(b) + _nbytes(d)
    assert counter.resident_bytes == expected
    assert counter.peak_resident_bytes == expected
    loss.backward()
    del c, d, loss
    gc.collect()
    counter.sample()
    assert counter.resident_bytes == 0
    assert counter.peak_resident_bytes == expected
    assert counter.offloaded_bytes == counter.peak_offloaded_bytes == 0


def test_one_storage_saved_twice_counts_once_and_parameters_are_excluded() -> None:
    w = torch.nn.Parameter(torch.randn(6, 5))
    x = torch.randn(2, 3, 6, requires_grad=True)
    with SavedActivationCounter(exclude=[w]) as counter:
        sq = x * x  # saves x twice (one storage)
        h = sq.view(6, 6) @ w  # saves the view of sq (sq's storage) and w (excluded)
        h.sum().backward()
    assert counter.peak_resident_bytes == _nbytes(x) + _nbytes(sq)
    assert counter.resident_bytes == 0


def test_peak_is_over_the_window_and_reset_starts_a_new_one() -> None:
    x = torch.randn(16, 16, requires_grad=True)
    with SavedActivationCounter() as counter:
        y = x.exp()  # saves its output
        big = y.exp()  # saves its output
        big.sum().backward()
        del y, big
        gc.collect()
        counter.reset_peaks()
        assert counter.peak_resident_bytes == 0
        z = x.tanh()  # saves its output only
        assert counter.peak_resident_bytes == _nbytes(z)
