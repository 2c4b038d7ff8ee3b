"""Device backends (cuda, musa, cpu) behind one interface; the only device-specific code.

``get_accelerator()`` picks one (``TITAN_ACCELERATOR`` or musa > cuda > cpu);
``install_megatron_compat()`` is the single, explicit start-up step that makes
megatron-core's ``torch.cuda`` calls answer on MUSA and CPU, and ``megatron_scope()`` the
context every call into megatron-core runs in (on CPU, its device-rewriting part).
"""

from titan_core.accelerator.base import Accelerator
from titan_core.accelerator.megatron_compat import megatron_scope
from titan_core.accelerator.registry import (
    AcceleratorError,
    accelerator_named,
    get_accelerator,
    register_accelerator,
    registered_accelerators,
    reset_accelerator,
    select_accelerator_name,
)

__all__ = [
    "Accelerator",
    "AcceleratorError",
    "accelerator_named",
    "get_accelerator",
    "megatron_scope",
    "register_accelerator",
    "registered_accelerators",
    "reset_accelerator",
    "select_accelerator_name",
]
