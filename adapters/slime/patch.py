"""What slime's MUSA bootstrap runs: Titan's megatron-core answers and Titan's switches.

slime imports a module ``musa_patch`` (found through ``MUSA_PATCH_PATH``) after torch and
before megatron-core and SGLang, and slime PR #2398 calls ``musa_titan.apply_rl_patch()``
(found through ``MUSA_TITAN_PATH``) during MUSA initialization. Both modules, in
``adapters/slime/bootstrap/``, call :func:`apply_rl_patch` here, so the work is done once
per process whichever slime asks first, and a second call changes nothing:

1. ``titan_core.accelerator``'s start-up step (``install_megatron_compat``): torchada on
   MUSA, the fixes megatron-core 0.16.1 needs without Transformer Engine, the CPU answers.
2. ``titan`` registered in slime's accelerator registry (``adapters.slime.register``).

Titan's switches reach slime's Megatron actor through one file: the Titan YAML named by
``TITAN_CONFIG`` (``adapters.common.config``). :func:`megatron_switches` reads it and gives
the Megatron-LM argument names slime's actor understands; :func:`apply_switches` sets them
on slime's ``args``.
"""

from __future__ import annotations

import os
from typing import Any

_APPLIED: str | None = None
_APPLYING = False


def apply_rl_patch() -> str:
    """Apply Titan's start-up answers once; returns the accelerator name they are for."""
    global _APPLIED, _APPLYING
    if _APPLIED is not None or _APPLYING:  # MUSA's post_import_torch calls musa_patch back
        return _APPLIED or ""
    _APPLYING = True
    try:
        from titan_core.accelerator import get_accelerator
        from titan_core.accelerator.megatron_compat import install_megatron_compat

        accel = get_accelerator()
        install_megatron_compat(accel)
        try:
            from adapters.slime.accelerator import register
        except ImportError:  # the bootstrap may run where slime is absent (miles' MUSA PR)
            pass
        else:
            register()
        _APPLIED = accel.name
    finally:
        _APPLYING = False
    return _APPLIED


def applied() -> str | None:
    """The accelerator the patch was applied for, or None."""
    return _APPLIED


def megatron_switches(path: str | None = None) -> dict[str, Any]:
    """Titan's optimization switches from the Titan YAML (``$TITAN_CONFIG``), as Megatron-LM
    arguments; {} without a file. Each is exactly the Titan key's value."""
    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig

    path = path or os.environ.get("TITAN_CONFIG")
    if not path:
        return {}
    cfg = load_config(GRPOConfig, path)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out: dict[str, Any] = {
        "moe_token_dispatcher_type": m.moe_token_dispatcher_type,
        "overlap_moe_expert_parallel_comm": p.overlap_moe_expert_parallel_comm,
        "overlap_p2p_comm": p.overlap_p2p_comm,
        "fp8": t.fp8,
        "fp8_recipe": t.fp8_recipe,
        "fine_grained_activation_offloading": bool(t.offload_modules),
        "offload_modules": list(t.offload_modules),
    }
    if m.moe_token_dispatcher_type == "flex":
        out["moe_flex_dispatcher_backend"] = m.moe_flex_dispatcher_backend
    return out


def apply_switches(args: Any, path: str | None = None) -> dict[str, Any]:
    """Set :func:`megatron_switches` on slime's ``args`` namespace; returns them."""
    switches = megatron_switches(path)
    for key, value in switches.items():
        setattr(args, key, value)
    return switches
