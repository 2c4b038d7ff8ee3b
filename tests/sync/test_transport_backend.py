"""The distributed transport takes the process-group backends the accelerator offers."""

from __future__ import annotations

import pytest
import torch

from titan_core.accelerator import get_accelerator, reset_accelerator
from titan_rl.sync.transports.distributed import DistributedSync, DistributedTransport


@pytest.fixture
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("TITAN_ACCELERATOR", "cpu")
    reset_accelerator()
    yield get_accelerator()
    reset_accelerator()


def test_a_backend_the_accelerator_lacks_is_refused_naming_the_key(cpu_accelerator):
    refused = r"sync\.distributed\.backend=nccl: not available on the cpu"
    with pytest.raises(ValueError, match=refused):
        DistributedTransport(DistributedSync(backend="nccl"), torch.device("cpu"), 600.0)
    transport = DistributedTransport(DistributedSync(backend="gloo"), torch.device("cpu"), 600.0)
    assert transport.backend == "gloo"
    unset = DistributedTransport(DistributedSync(), torch.device("cpu"), 600.0)
    assert unset.backend == cpu_accelerator.weight_update_backend_for("cpu")
