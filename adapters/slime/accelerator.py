"""``titan``: a backend of slime's accelerator registry that answers with Titan's accelerator.

slime's registry (``slime.utils.accelerator``) has ``cuda`` and ``musa`` and no CPU
backend. :func:`register` adds ``titan``: every call slime makes (device, streams, memory,
RNG, process-group and weight-update backends) is answered by ``titan_core.accelerator``,
which picks MUSA (mccl), CUDA (nccl) or CPU (gloo) by its own rules. With
``SLIME_ACCELERATOR=titan``, slime's own device code runs wherever Titan does, CPU included.

slime selects its backend in each process on its own (at the import of
``slime.backends.sglang_utils`` and ``slime.backends.megatron_utils``, else at the first
device call), so ``titan`` must be registered in each: :func:`setup_worker` is Ray's
``worker_process_setup_hook`` for that (:data:`adapters.slime.runtime_env.SETUP_HOOK`; Ray
runs it when a worker starts, before it loads any task or actor), and
``python -m adapters.slime.launch`` does it for slime's driver. When slime selects ``titan``,
the backend runs what slime's MUSA bootstrap would (:func:`adapters.slime.patch.apply_rl_patch`:
the vendor's ``musa_patch``, torchada, Titan's megatron-core answers), as slime does for
``musa`` before constructing it: slime imports no ``musa_patch`` for any other backend and
calls no ``post_import_torch()`` at 624b824a.
"""

from __future__ import annotations

from typing import Any

import torch

from adapters.peers import import_peer

_slime_acc = import_peer("slime.utils.accelerator")
_slime_base = import_peer("slime.utils.accelerator.base")

#: the name slime selects this backend by (``SLIME_ACCELERATOR=titan``)
NAME = "titan"
#: below musa (200) and cuda (100): auto-selection keeps slime's own backends where they
#: run; ``titan`` is picked automatically only where neither does (CPU), or when asked for.
PRIORITY = 10


def _titan() -> Any:
    from titan_core.accelerator import get_accelerator

    return get_accelerator()


def _index(device: Any) -> int | None:
    if device is None or isinstance(device, int):
        return device
    if isinstance(device, torch.device):
        return device.index
    text = str(device)
    return int(text.split(":")[1]) if ":" in text else None


class TitanAccelerator(_slime_base.Accelerator):
    """slime's ``Accelerator`` contract over Titan's accelerator of this process."""

    name = NAME

    def __init__(self) -> None:
        """slime constructs its backend when it selects it: Titan's start-up answers first."""
        from adapters.slime.patch import apply_rl_patch

        apply_rl_patch()
        self._t = _titan()
        register()  # this process's device is known now: the exact communication backend

    # ---- identity ----------------------------------------------------------------------------
    @property
    def device_type(self) -> str:  # type: ignore[override]
        return self._t.device_type

    @property
    def communication_backend_name(self) -> str:  # type: ignore[override]
        return self._t.communication_backend()

    @property
    def titan(self) -> Any:
        """The Titan accelerator answering (``titan_core.accelerator.Accelerator``)."""
        return self._t

    def is_available(self) -> bool:
        return self._t.is_available()

    def device(self, index: Any = None) -> torch.device:
        return self._t.device(_index(index))

    def device_name(self, index: Any = None) -> str:
        return self._t.device_name(_index(index))

    def set_device(self, index: Any) -> None:
        self._t.set_device(_index(index) or 0)

    def current_device(self) -> int | str:
        return "cpu" if self._t.device_type == "cpu" else self._t.current_device()

    def device_count(self) -> int:
        return self._t.device_count()

    # ---- streams, sync ----------------------------------------------------------------------
    def synchronize(self, device: Any = None) -> None:
        self._t.synchronize(device)

    def current_stream(self, device: Any = None) -> Any:
        return self._t.current_stream(device)

    def default_stream(self, device: Any = None) -> Any:
        return self._t.default_stream(device)

    def stream(self, stream: Any) -> Any:
        return self._t.stream(stream)

    @property
    def Stream(self) -> Any:  # noqa: N802 - slime's name
        return self._t.Stream

    @property
    def Event(self) -> Any:  # noqa: N802 - slime's name
        return self._t.Event

    # ---- memory -------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        self._t.empty_cache()

    def ipc_collect(self) -> None:
        self._t.ipc_collect()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self._t.mem_get_info(device)

    def memory_allocated(self, device: Any = None) -> int:
        return self._t.memory_allocated(device)

    def memory_reserved(self, device: Any = None) -> int:
        return self._t.memory_reserved(device)

    def get_device_properties(self, device: Any = None) -> Any:
        return self._t.get_device_properties(device)

    # ---- RNG, capabilities ----------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._t.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._t.manual_seed_all(seed)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return self._t.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        self._t.set_rng_state(state, device)

    def supports(self, capability: str) -> bool:
        return self._t.supports(capability)

    def autocast(self, *args: Any, **kwargs: Any) -> Any:
        return self._t.autocast(*args, **kwargs)

    def accelerator_module(self) -> Any:
        return self._t.accelerator_module

    def distributed_device_id(self, index: Any = None) -> torch.device | None:
        return self._t.distributed_device_id(_index(index) or 0)

    @property
    def visible_devices_env(self) -> str:
        return self._t.visible_devices_env or "CUDA_VISIBLE_DEVICES"

    # ---- communication -----------------------------------------------------------------------
    def communication_backend(self, default: str = "nccl") -> str:
        """slime asks with its default ("nccl"): that means this device's own backend."""
        return self._t.communication_backend() if default == "nccl" else default

    def weight_update_backend(self, default: str = "nccl") -> str:
        return self._t.weight_update_backend() if default == "nccl" else default

    def post_import_torch(self) -> None:
        """Titan's start-up answers (done when slime selected this backend; once)."""
        from adapters.slime.patch import apply_rl_patch

        apply_rl_patch()


def _available() -> bool:
    try:
        return _titan().is_available()
    except Exception:
        return False


def register(priority: int = PRIORITY, probe: bool = True) -> None:
    """Register ``titan`` in slime's accelerator registry (idempotent). Select it with
    ``SLIME_ACCELERATOR=titan``; without that it is chosen only where slime's own backends
    are unavailable (a CPU machine). ``probe=False`` touches no device (availability is
    asked when slime selects; the communication backend is filled in then)."""
    backends = (_titan().communication_backend(),) if probe and _available() else ()
    _slime_acc.register_accelerator(
        NAME, TitanAccelerator, _available, priority=priority, communication_backends=backends
    )


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: ``titan`` in this process's slime registry before
    any actor class is loaded. Asks no device: Ray sets the visible devices afterwards."""
    register(probe=False)
