"""slime's MUSA bootstrap module ``musa_patch`` (found through ``MUSA_PATCH_PATH``; slime at
624b824a imports it when it selects its ``musa`` backend, before constructing it, and its
``MUSAAccelerator.post_import_torch()`` would call ``patch_after_import_torch()``).

It does not shadow the vendor's module of the same name: importing it runs
:func:`adapters.slime.patch.apply_rl_patch` (once per process), which first imports the
vendor's ``musa_patch`` found elsewhere (``$TITAN_VENDOR_MUSA_PATCH_PATH``, ``sys.path``)
and calls its ``patch_after_import_torch()``, then adds Titan's answers. Any other name
read from this module is the vendor's.
"""

from __future__ import annotations

from typing import Any

from adapters.slime.bootstrap import apply_and_register
from adapters.slime.patch import run_vendor_bootstrap, vendor_musa_patch


def patch_after_import_torch() -> None:
    """The vendor's hook (once), then Titan's answers (once)."""
    run_vendor_bootstrap()
    apply_and_register()


def __getattr__(name: str) -> Any:
    vendor = vendor_musa_patch()
    if vendor is None or name.startswith("__"):
        raise AttributeError(f"module 'musa_patch' has no attribute {name!r}")
    return getattr(vendor, name)


apply_and_register()
