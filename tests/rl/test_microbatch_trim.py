"""Rows sorted into microbatches cut to their own longest row (titan_rl.trainer.microbatch):
the plan itself, and a real trainer whose logprobs, step metrics and gradients equal those
of full-length microbatches and whose logprobs equal HF transformers' on each sample alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.hf_cases import build_hf_model
from titan_rl.trainer.microbatch import needed_lengths, plan_microbatches

REPO = Path(__file__).resolve().parents[2]


def test_needed_lengths_end_at_the_last_trained_label() -> None:
    mask = torch.zeros(4, 9)
    mask[0, 2:5] = 1  # positions 2-4 score tokens 3-5: 6 tokens needed
    mask[1, 8] = 1  # the last position: every token
    mask[2, 3:7] = torch.tensor([1.0, 0.0, 1.0, 0.0])  # a tool reply after the last trained
    assert needed_lengths(mask).tolist() == [6, 10, 7, 1]  # row 3 trains nothing


def test_plan_sorts_rows_cuts_each_microbatch_and_restores_the_order() -> None:
    lengths = torch.tensor([5, 40, 3, 17, 9, 2])
    plan = plan_microbatches(lengths, size=2, width=48, multiple=8)
    assert plan.order.tolist() == [1, 3, 4, 0, 2, 5]
    assert plan.widths == (40, 16, 8)
    fields = {"tokens": torch.arange(6 * 48).reshape(6, 48), "mask": torch.ones(6, 47)}
    mbs = list(plan.batches(fields, torch.device("cpu")))
    assert [tuple(mb["tokens"].shape) for mb in mbs] == [(2, 40), (2, 16), (2, 8)]
    assert [tuple(mb["mask"].shape) for mb in mbs] == [(2, 39), (2, 15), (2, 7)]
    assert mbs[1]["tokens"][:, 0].tolist() == [4 * 48, 0]  # rows 4 and 0
    per_row = torch.cat([mb["tokens"][:, :1] for mb in mbs])
    assert plan.restore(per_row)[:, 0].tolist() == [r * 48 for r in range(6)]
    # no row gets longer than the batch; one stage or many: as given, full length
    assert plan_microbatches(torch.tensor([47, 47]), 1, 48).widths == (48, 48)
    whole = plan_microbatches(lengths, 2, 48, trim=False)
    assert whole.order is None and whole.widths == (48, 48, 48)


@pytest.mark.slow  # a trainer process of its own: ~15 s
@pytest.mark.parametrize("family", ["qwen3_moe"])  # MoE routers, attention, padded vocab
def test_trimmed_microbatches_train_as_full_length_ones(tmp_path, family) -> None:
    build_hf_model(family).save_pretrained(tmp_path / "hf")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/rl/microbatch_worker.py"),
         "--model-dir", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run"),
         "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    trimmed, full = got["trimmed"], got["full"]
    width = got["width"]
    assert full["widths"] == [width] * 4
    # the long tail sits in one microbatch, cut to its longest row (rounded up to the
    # accelerator's multiple: none on CPU); the others are cut well short of it
    from tests.rl.microbatch_worker import PROMPT_LENGTHS, RESPONSE_LENGTHS
    from titan_core.accelerator.cpu import CpuAccelerator

    m = CpuAccelerator.sequence_multiple
    longest = max(p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True))
    assert max(trimmed["widths"]) == min(width, -(-longest // m) * m)
    assert sorted(trimmed["widths"])[:3] < [max(trimmed["widths"])] * 3
    assert sum(trimmed["widths"]) < 0.6 * sum(full["widths"])

    lp_t, lp_f, ref = (torch.tensor(x) for x in (trimmed["logprobs"], full["logprobs"], got["hf"]))
    assert (lp_t - lp_f).abs().max() < 1e-5
    assert (lp_t - ref).abs().max() < 1e-4  # HF transformers, each sample alone
    # whole-batch metrics (per-microbatch means such as train/pg_loss depend on the grouping)
    for key in ("train/grad_norm", "train/rollout_logprob_abs_diff"):
        assert trimmed["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-5), key
    for gt, gf in zip(trimmed["grads"], full["grads"], strict=True):
        gt, gf = torch.tensor(gt), torch.tensor(gf)
        assert (gt - gf).abs().max() <= 1e-5 * max(1.0, float(gf.abs().max())), gf.shape
    assert any(torch.tensor(g).abs().max() > 0 for g in full["grads"])


@pytest.mark.parametrize("rank", [0, 1])
def test_padding_rows_leave_the_softmax_on_each_tp_slice(monkeypatch, rank) -> None:
    """An HF policy of 300 ids padded to 384 rows at TP 2: rank 1 holds ids 192-383, of which
    300-383 are padding. Its scores drop out of the softmax; the real ids are untouched."""
    from megatron.core import parallel_state

    from titan_rl.trainer.policy import without_padding_rows

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    full = torch.randn(3, 384)
    local = full[:, rank * 192 : (rank + 1) * 192]
    masked = without_padding_rows(local, 300)
    real = 300 - rank * 192 if rank else 192
    assert torch.equal(masked[:, :real], local[:, :real])
    assert (masked[:, real:] == torch.finfo(torch.float32).min).all()
    assert masked.data_ptr() != local.data_ptr()  # megatron's cross entropy may write to it
    if rank:  # with rank 0's slice (no padding there): the softmax of the 300 real ids
        both = torch.cat([full[:, :192], masked], dim=1)
        ref = torch.log_softmax(full[:, :300], -1)
        assert torch.allclose(torch.log_softmax(both, -1)[:, :300], ref, atol=1e-6)


#: token_logprobs in a one-rank process group with megatron's parallel state (TP 1)
_TP1_LOGPROBS = """
import json, torch, torch.distributed as dist
from megatron.core import parallel_state
from titan_core.accelerator.cpu import CpuAccelerator
from titan_core.accelerator.megatron_compat import install_megatron_compat
from titan_core.net import free_port
from titan_rl.trainer.policy import token_logprobs, without_padding_rows
install_megatron_compat(CpuAccelerator())
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
parallel_state.initialize_model_parallel()
g = torch.Generator().manual_seed(0)
logits = torch.randn(4, 7, 128, generator=g)
logits[..., 100:] = 50.0  # padding rows scoring high: they must not count
kept = without_padding_rows(logits, 100)
targets = torch.randint(0, 100, (4, 7), generator=g)
ref = torch.log_softmax(logits[..., :100].double(), -1).gather(-1, targets[..., None])[..., 0]
got = token_logprobs(logits, targets, 100)
print(json.dumps({
    "shape": list(kept.shape), "same_values": torch.equal(kept, logits[..., :100]),
    "a_copy": kept.is_contiguous() and kept.data_ptr() != logits.data_ptr(),
    "max_err": (got.double() - ref).abs().max().item(),
    "input_untouched": torch.equal(logits[..., 100:], torch.full((4, 7, 28), 50.0)),
}))
"""


def test_at_tp1_padding_rows_are_left_out_and_the_logprobs_are_the_vocabularys() -> None:
    """At TP 1 the padding rows are dropped (a copy: megatron's cross entropy writes to its
    input), and the token logprobs through megatron's vocab-parallel cross entropy are an
    fp64 log-softmax's over the real ids, whatever the padding rows hold."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _TP1_LOGPROBS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["shape"] == [4, 7, 100] and seen["same_values"] and seen["a_copy"]
    assert seen["max_err"] < 1e-5 and seen["input_untouched"]
