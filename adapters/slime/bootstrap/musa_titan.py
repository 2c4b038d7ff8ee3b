"""slime's MUSA bootstrap module ``musa_titan`` (slime PR #2398, open: found through
``MUSA_TITAN_PATH``, ``apply_rl_patch()`` called during MUSA initialization, with
``patch_after_import_torch()`` kept for older ``musa_titan`` interfaces).

Point ``MUSA_TITAN_PATH`` (and ``MUSA_PATCH_PATH``, for slime before that PR) at this
folder. :func:`apply_rl_patch` runs the vendor's ``musa_patch`` (``$MUSA_PATCH_PATH`` may
name the vendor's folder here), then Titan's answers, once per process
(:mod:`adapters.slime.patch`).
"""

from __future__ import annotations

from adapters.slime.bootstrap import apply_and_register
from adapters.slime.patch import apply_switches, megatron_switches


def apply_rl_patch() -> str:
    """What slime (PR #2398) calls during MUSA initialization: Titan's start-up answers and
    ``titan`` in slime's registry (once per process)."""
    return apply_and_register()


def patch_after_import_torch() -> None:
    """The older entry point: the same work as :func:`apply_rl_patch`."""
    apply_rl_patch()


__all__ = ["apply_rl_patch", "apply_switches", "megatron_switches", "patch_after_import_torch"]
