"""What slime's MUSA bootstrap runs: the vendor's bootstrap, then Titan's answers, and
Titan's switches.

slime (at 624b824a) imports a module ``musa_patch`` (appending ``$MUSA_PATCH_PATH`` to
``sys.path``) when it selects its ``musa`` backend, before constructing it; slime PR #2398
calls ``musa_titan.apply_rl_patch()`` (found through ``$MUSA_TITAN_PATH``) there instead;
with ``SLIME_ACCELERATOR=titan`` slime runs neither, and Titan's backend calls
:func:`apply_rl_patch` when slime selects it (``adapters.slime.accelerator``). Every way
in does the work once per process:

1. The vendor's bootstrap, not shadowed by Titan's module of the same name: a ``musa_patch``
   outside ``adapters/slime/bootstrap`` (:func:`find_vendor_musa_patch`: the folder
   ``$TITAN_VENDOR_MUSA_PATCH_PATH``, then ``$MUSA_PATCH_PATH``, then ``sys.path``) is
   imported and its ``patch_after_import_torch()`` called, as slime would have.
2. ``titan_core.accelerator``'s start-up step (``install_megatron_compat``): torch_musa and
   torchada on MUSA, the fixes megatron-core 0.16.1 needs without Transformer Engine, the
   CPU answers.
3. ``titan`` registered in slime's accelerator registry (``adapters.slime.register``).

Titan's switches reach slime's Megatron actor through one file: the Titan YAML named by
``TITAN_CONFIG`` (``adapters.common.config``). :func:`megatron_switches` reads it and gives
the Megatron-LM argument names slime's actor understands; :func:`apply_switches` sets them
on slime's ``args``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

#: the folder ``MUSA_PATCH_PATH`` / ``MUSA_TITAN_PATH`` point at for Titan's modules
BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
#: a folder holding the vendor's ``musa_patch`` where ``MUSA_PATCH_PATH`` names Titan's
VENDOR_PATH_ENV = "TITAN_VENDOR_MUSA_PATCH_PATH"
#: the name the vendor's module is loaded under while Titan's holds ``musa_patch``
VENDOR_ALIAS = "titan_vendor_musa_patch"

_APPLIED: str | None = None
_APPLYING = False
_VENDOR: ModuleType | None = None
_VENDOR_DONE = False


def _is_titans(path: str | os.PathLike[str] | None) -> bool:
    return bool(path) and Path(path).resolve().parent == BOOTSTRAP_DIR


def find_vendor_musa_patch() -> importlib.machinery.ModuleSpec | None:
    """Where the vendor's ``musa_patch`` is: the first one in ``$TITAN_VENDOR_MUSA_PATCH_PATH``,
    ``$MUSA_PATCH_PATH``, then ``sys.path`` that is not Titan's own; None if there is none."""
    folders = [os.environ.get(VENDOR_PATH_ENV), os.environ.get("MUSA_PATCH_PATH"), *sys.path]
    for folder in folders:
        if not isinstance(folder, str) or Path(folder or ".").resolve() == BOOTSTRAP_DIR:
            continue
        spec = importlib.machinery.PathFinder.find_spec("musa_patch", [folder or "."])
        if spec is not None and spec.origin and not _is_titans(spec.origin):
            return spec
    return None


def vendor_musa_patch() -> ModuleType | None:
    """The vendor's ``musa_patch``, imported once (under its own name where Titan's does not
    hold it, else as :data:`VENDOR_ALIAS`); None where there is none."""
    global _VENDOR, _VENDOR_DONE
    if _VENDOR_DONE:
        return _VENDOR
    _VENDOR_DONE = True
    held = sys.modules.get("musa_patch")
    if held is not None and not _is_titans(getattr(held, "__file__", None)):
        _VENDOR = held  # slime, or the vendor's own set-up, imported it already
        return _VENDOR
    spec = find_vendor_musa_patch()
    if spec is None:
        return None
    name = VENDOR_ALIAS if held is not None else "musa_patch"
    spec = importlib.util.spec_from_file_location(
        name, spec.origin, submodule_search_locations=spec.submodule_search_locations
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _VENDOR = module
    return module


def run_vendor_bootstrap() -> ModuleType | None:
    """Step 1: the vendor's ``musa_patch`` imported and its ``patch_after_import_torch()``
    called (once per process, whoever asks); returns the module, or None."""
    module = vendor_musa_patch()
    if module is not None:
        from titan_core.accelerator.musa import call_patch_hook

        call_patch_hook(module)
    return module


def apply_rl_patch() -> str:
    """The vendor's bootstrap, then Titan's start-up answers, once; returns the name of the
    accelerator they are for."""
    global _APPLIED, _APPLYING
    if _APPLIED is not None or _APPLYING:  # MUSA's post_import_torch calls musa_patch back
        return _APPLIED or ""
    _APPLYING = True
    try:
        run_vendor_bootstrap()
        from titan_core.accelerator import get_accelerator
        from titan_core.accelerator.megatron_compat import install_megatron_compat

        accel = get_accelerator()
        install_megatron_compat(accel)
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
