"""``import_megatron``: on CPU megatron-core is imported without ``torch.compile`` on its
fusion functions (no dynamo, no inductor at import), with the same training as the compiled
import gives; an accelerator that compiles keeps megatron's own choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.core.pretrain_runner import FAST, TINY_MOE, losses, run_pretrain

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU import is for CPU hosts")

#: what a fresh process sees after ``import_megatron`` of the named accelerator class
_PROBE = """
import json, sys, torch
from titan_core.accelerator.{module} import {cls}
from titan_core.accelerator.megatron_compat import import_megatron
compile_before = torch.compile
import_megatron({cls}())
import megatron.core.jit as jit
from megatron.core.fusions.fused_bias_geglu import geglu
from megatron.core.transformer.moe.router import TopKRouter  # imported after: the later modules
print(json.dumps({{
    "dynamo": "torch._dynamo" in sys.modules,
    "inductor": "torch._inductor.compile_fx" in sys.modules,
    "noop_fuser": jit.jit_fuser is jit.noop_decorator,
    "compile_restored": torch.compile is compile_before,
    "plain_functions": all(
        type(f).__name__ == "function" and not hasattr(f, "_torchdynamo_orig_callable")
        for f in (geglu, TopKRouter._apply_expert_bias)
    ),
}}))
"""


def _probe(module: str, cls: str) -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module, cls=cls)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_imports_megatron_without_the_compiler():
    seen = _probe("cpu", "CpuAccelerator")
    assert seen == {
        "dynamo": False,
        "inductor": False,
        "noop_fuser": True,
        "compile_restored": True,
        "plain_functions": True,
    }


def test_a_compiling_accelerator_keeps_megatrons_fuser():
    seen = _probe("cuda", "CudaAccelerator")  # its class's choice; no device is touched
    assert seen["dynamo"] and not seen["noop_fuser"] and seen["compile_restored"]
    assert not seen["plain_functions"]


@pytest.mark.slow
def test_moe_pretraining_matches_the_compiled_import(tmp_path):
    """The MoE router's expert-bias count is the one fusion function a CPU run calls: the
    pretrain command (uncompiled import) and the same command in a process that imported
    megatron-core first (megatron's torch.compile'd functions) give identical losses."""
    moe = [
        *FAST, "train.train_iters=3", "model.num_layers=2",
        "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
    ]  # fmt: skip
    eager = tmp_path / "eager"
    run_pretrain(TINY_MOE, [*moe, f"run.dir={eager}"])
    compiled = tmp_path / "compiled"
    args = ["--config", TINY_MOE, *moe, f"run.dir={compiled}"]
    code = (
        f"import sys, megatron.core; from titan_core.pretrain import main; sys.exit(main({args!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert len(losses(eager)) == 3
    assert losses(eager) == losses(compiled)
