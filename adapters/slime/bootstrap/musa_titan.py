"""slime's MUSA bootstrap module ``musa_titan`` (slime PR #2398: found through
``MUSA_TITAN_PATH``, ``apply_rl_patch()`` called during MUSA initialization).

Point ``MUSA_TITAN_PATH`` (and ``MUSA_PATCH_PATH``, for slime releases before that PR) at
this folder. The work is :func:`adapters.slime.patch.apply_rl_patch`: done once per process.
"""

from adapters.slime.patch import apply_rl_patch, apply_switches, megatron_switches

__all__ = ["apply_rl_patch", "apply_switches", "megatron_switches"]
