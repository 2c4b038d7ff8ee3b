"""slime's MUSA bootstrap module ``musa_patch`` (found through ``MUSA_PATCH_PATH``, imported
once after torch and before megatron-core and SGLang; ``patch_after_import_torch()`` is the
hook slime's MUSA accelerator calls).

Importing it applies Titan's start-up answers (:func:`adapters.slime.patch.apply_rl_patch`,
once per process); calling the hook again changes nothing.
"""

from adapters.slime.patch import apply_rl_patch


def patch_after_import_torch() -> None:
    apply_rl_patch()


apply_rl_patch()
