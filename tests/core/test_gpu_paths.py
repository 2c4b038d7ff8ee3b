"""What the first GPU run (an H200 without Apex or Transformer Engine) found, pinned on CPU.

1. megatron's local layer spec asserts when ``persist_layer_norm`` is asked for without Apex
   (``WrappedTorchNorm``); the config asked for it on every non-CPU device.
2. NCCL reduces device tensors only; the step's loss and the eval figures were reduced as CPU
   tensors, which gloo accepts and NCCL refuses ("No backend type associated with device
   type cpu").
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from titan_core.accelerator.cuda import CudaAccelerator
from titan_core.config.pretrain import PretrainConfig
from titan_core.models.gpt import build_transformer_config
from titan_core.training import loop

APEX = importlib.util.find_spec("apex") is not None


@pytest.mark.skipif(APEX, reason="checks the configuration of a machine without Apex")
def test_cuda_without_apex_asks_for_no_apex_kernels():
    accel = CudaAccelerator()
    assert accel.supports("fused_kernels") is False
    tf = build_transformer_config(PretrainConfig(), accel)
    assert tf.persist_layer_norm is False
    assert tf.masked_softmax_fusion is False
    # the module the local spec builds for every layer's norms accepts this config
    norm = WrappedTorchNorm(tf, hidden_size=tf.hidden_size, eps=tf.layernorm_epsilon)
    assert norm(torch.ones(2, tf.hidden_size)).shape == (2, tf.hidden_size)


class _OnDevice:
    def __init__(self, device: torch.device) -> None:
        self._device = device

    def device(self) -> torch.device:
        return self._device


def test_loss_and_eval_are_reduced_on_the_accelerator(monkeypatch):
    """The collectives get tensors on the accelerator's device (meta stands in for a GPU)."""
    seen: list[torch.device] = []
    monkeypatch.setattr(loop, "get_accelerator", lambda: _OnDevice(torch.device("meta")))
    monkeypatch.setattr(loop.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loop.dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    monkeypatch.setattr(loop.parallel_state, "is_pipeline_last_stage", lambda **k: False)
    monkeypatch.setattr(loop.parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    with pytest.raises((NotImplementedError, RuntimeError)):  # meta tensors hold no values
        loop._reduce_loss([])
    with pytest.raises((NotImplementedError, RuntimeError)):
        loop._reduce_eval([])
    assert seen == [torch.device("meta"), torch.device("meta")]
