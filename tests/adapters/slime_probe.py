"""A Ray actor module loaded as slime's rollout manager module is: it imports
``slime.backends.sglang_utils`` at the top, whose import selects slime's accelerator
(``initialize_accelerator()``). Nothing here registers Titan's backend: with
``SLIME_ACCELERATOR=titan`` this module imports only where the job's
``worker_process_setup_hook`` did that before Ray loaded it."""

from __future__ import annotations

import os
from typing import Any

import slime.backends.sglang_utils  # noqa: F401 - slime's import-time selection
from slime.utils import accelerator

from titan_core.accelerator.megatron_compat import megatron_compat_installed

#: what slime's selection gave while this module was being imported
SELECTED_AT_IMPORT = accelerator.initialize_accelerator().name
#: Titan's start-up answers, installed by the time slime had selected its backend
COMPAT_AT_IMPORT = megatron_compat_installed()


class Probe:
    """Reports what slime's accelerator API answers in this worker."""

    def report(self) -> dict[str, Any]:
        return {
            "at_import": SELECTED_AT_IMPORT,
            "compat_at_import": COMPAT_AT_IMPORT,
            "name": accelerator.get_accelerator().name,
            "device": str(accelerator.device()),
            "pg": accelerator.process_group_backend(),
            "gloo_is_device_backend": accelerator.is_accelerator_backend("gloo"),
            "pid": os.getpid(),
        }
