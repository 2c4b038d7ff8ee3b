"""The distributed transport takes the process-group backends the accelerator offers."""

from __future__ import annotations

import pytest
import torch

from titan_core.accelerator import get_accelerator, reset_accelerator
from titan_rl.sync.config import SyncConfig
from titan_rl.sync.transports import DistributedTransport


@pytest.fixture
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("TITAN_ACCELERATOR", "cpu")
    reset_accelerator()
    yield get_accelerator()
    reset_accelerator()


def test_a_backend_the_accelerator_lacks_is_refused_naming_the_key(cpu_accelerator):
    cfg = SyncConfig(transport="distributed")
    refused = r"sync\.distributed\.backend 'nccl' is not available on the cpu"
    with pytest.raises(ValueError, match=refused):
        DistributedTransport(cfg, torch.device("cpu"), "nccl")
    transport = DistributedTransport(cfg, torch.device("cpu"), "gloo")
    assert transport.backend == "gloo"
