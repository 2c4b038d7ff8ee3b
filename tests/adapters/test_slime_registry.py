"""slime's real accelerator registry selects ``titan``; its shims answer on CPU; the MUSA
bootstrap modules are found through MUSA_PATCH_PATH / MUSA_TITAN_PATH as slime looks them
up and applied once; a missing peer package is an error naming it.

Each case runs in a fresh interpreter: slime's registry and Titan's start-up answers are
per-process state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("slime.utils.accelerator", reason="slime's wheel (../shared/peers) is needed")

REPO = Path(__file__).resolve().parents[2]
BOOTSTRAP = REPO / "adapters/slime/bootstrap"


def _run(code: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLIME_", "MUSA_", "TITAN_"))}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, cwd=REPO, env={**clean, **env}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_registry_selects_titan_and_its_shims_answer_on_cpu():
    out = _run(
        """
        import json, torch
        import adapters.slime as titan_slime
        from slime.utils import accelerator as acc
        titan_slime.register()
        a = acc.get_accelerator()
        acc.set_device(0)
        acc.synchronize()
        s, e = acc.new_stream(), acc.new_event()
        with acc.stream(s):
            x = torch.ones(3, device=acc.device()) * 2
        e.record()
        acc.manual_seed(7)
        r1 = torch.rand(2)
        acc.set_rng_state(acc.get_rng_state())
        free, total = acc.mem_get_info()
        print(json.dumps({
            "name": a.name, "type": acc.device_type(), "device": str(acc.device()),
            "pg": acc.process_group_backend(), "pg_gloo": acc.process_group_backend("gloo"),
            "wu": acc.weight_update_backend(), "count": acc.device_count(),
            "x": x.sum().item(), "mem": [free > 0, total >= free], "alloc": acc.memory_allocated() >= 0,
            "is_accel_gloo": acc.is_accelerator_backend("gloo"),
        }))
        """,
        SLIME_ACCELERATOR="titan",
    )
    assert out["name"] == "titan" and out["type"] == "cpu" and out["device"] == "cpu"
    assert out["pg"] == "gloo" and out["pg_gloo"] == "gloo" and out["wu"] == "gloo"
    assert out["count"] == 1 and out["x"] == 6.0 and out["mem"] == [True, True] and out["alloc"]
    assert out["is_accel_gloo"]


def test_without_the_variable_titan_is_picked_where_slime_has_no_backend():
    out = _run(
        """
        import json
        import adapters.slime as titan_slime
        from slime.utils import accelerator as acc
        before = acc.initialize_accelerator()   # slime alone: no CPU backend
        titan_slime.register()
        acc.reset_accelerator()
        print(json.dumps({"before": before is None, "after": acc.get_accelerator().name}))
        """
    )
    assert out == {"before": True, "after": "titan"}


def test_musa_patch_path_bootstrap_applies_once():
    """slime's own lookup (append $MUSA_PATCH_PATH, import musa_patch) and its MUSA
    accelerator's post_import_torch hook both reach Titan's patch; the second changes nothing.
    (On a MUSA machine Titan picks musa by itself; here it is told its device is the CPU.)"""
    out = _run(
        """
        import json
        from slime.utils import accelerator as acc
        from slime.utils.accelerator.musa import MUSAAccelerator
        from titan_core.accelerator import megatron_compat
        found = acc._import_musa_patch()              # slime's bootstrap of musa_patch
        import adapters.slime.patch as patch
        n = len(megatron_compat._PATCHES)
        MUSAAccelerator().post_import_torch()          # calls musa_patch.patch_after_import_torch
        again = acc._import_musa_patch()
        import musa_patch
        print(json.dumps({
            "found": found, "again": again, "applied": patch.applied(),
            "compat": megatron_compat.megatron_compat_installed(), "patches": n,
            "unchanged": len(megatron_compat._PATCHES) == n,
            "module": musa_patch.__file__, "titan_registered": "titan" in acc._REGISTRY,
        }))
        """,
        MUSA_PATCH_PATH=str(BOOTSTRAP),
        TITAN_ACCELERATOR="cpu",  # MUSA_PATCH_PATH alone means musa, which this machine lacks
    )
    assert out["found"] and out["again"] and out["applied"] == "cpu" and out["compat"] == "cpu"
    assert out["patches"] > 0 and out["unchanged"] and out["titan_registered"]
    assert Path(out["module"]).parent == BOOTSTRAP


def test_titan_backends_post_import_hook_installs_titans_answers():
    """slime calls ``post_import_torch()`` on the backend it selected: for ``titan`` that is
    megatron-core's answers from Titan's accelerator (once; a second call changes nothing)."""
    out = _run(
        """
        import json
        import adapters.slime as titan_slime
        from slime.utils import accelerator as acc
        from titan_core.accelerator import megatron_compat
        titan_slime.register()
        before = megatron_compat.megatron_compat_installed()
        acc.post_import_torch()
        n = len(megatron_compat._PATCHES)
        acc.post_import_torch()
        print(json.dumps({
            "name": acc.get_accelerator().name, "before": before,
            "after": megatron_compat.megatron_compat_installed(),
            "unchanged": len(megatron_compat._PATCHES) == n,
        }))
        """,
        SLIME_ACCELERATOR="titan",
    )
    assert out == {"name": "titan", "before": None, "after": "cpu", "unchanged": True}


def test_musa_titan_path_bootstrap_applies_once():
    """slime PR #2398's lookup: $MUSA_TITAN_PATH on sys.path, import musa_titan, call
    apply_rl_patch() (the wheel predates the PR, so the lookup is done here as it does it)."""
    out = _run(
        """
        import importlib, json, os, sys
        sys.path.append(os.environ["MUSA_TITAN_PATH"])
        musa_titan = importlib.import_module("musa_titan")
        from titan_core.accelerator import megatron_compat
        first = musa_titan.apply_rl_patch()
        n = len(megatron_compat._PATCHES)
        second = musa_titan.apply_rl_patch()
        print(json.dumps({"first": first, "second": second,
                          "unchanged": len(megatron_compat._PATCHES) == n}))
        """,
        MUSA_TITAN_PATH=str(BOOTSTRAP),
        TITAN_ACCELERATOR="cpu",
    )
    assert out == {"first": "cpu", "second": "cpu", "unchanged": True}


def test_titan_switches_reach_slime_args_from_one_file(tmp_path):
    from adapters.slime.patch import apply_switches, megatron_switches

    cfg = tmp_path / "titan.yaml"
    cfg.write_text(
        "model: {num_moe_experts: 4, moe_token_dispatcher_type: flex}\n"
        "parallel: {overlap_moe_expert_parallel_comm: true}\n"
        "train: {fp8: e4m3, fp8_recipe: blockwise, offload_modules: [core_attn]}\n"
    )
    sw = megatron_switches(str(cfg))
    assert sw["fp8"] == "e4m3" and sw["fp8_recipe"] == "blockwise"
    assert (
        sw["moe_token_dispatcher_type"] == "flex" and sw["moe_flex_dispatcher_backend"] == "deepep"
    )
    assert sw["overlap_moe_expert_parallel_comm"] is True
    assert sw["fine_grained_activation_offloading"] is True and sw["offload_modules"] == [
        "core_attn"
    ]

    class Args:  # slime's args is a plain namespace
        pass

    args = Args()
    assert apply_switches(args, str(cfg)) == sw
    assert args.fp8 == "e4m3" and args.offload_modules == ["core_attn"]
    assert megatron_switches(None) == {} or "TITAN_CONFIG" in os.environ


def test_missing_peer_package_is_an_error_naming_it():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['slime'] = None\n"
         "import adapters.slime.accelerator"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "PeerImportError" in last and "slime package is not installed" in last
    assert "shared/peers/slime" in last


def test_peer_with_a_missing_dependency_names_the_dependency():
    from adapters.peers import PeerImportError, import_peer

    with pytest.raises(PeerImportError, match="has no module 'slime.not_a_module'"):
        import_peer("slime.not_a_module")
