"""Registry of accelerator backends, in the shape of slime's.

Selection order: ``TITAN_ACCELERATOR`` (or slime's ``SLIME_ACCELERATOR``, unless it is
``titan`` or ``auto``, which leave the choice to Titan) if set; else
``MUSA_VISIBLE_DEVICES`` / ``MUSA_PATCH_PATH`` mean musa; else the available backend with
the highest priority (musa 200, cuda 100, cpu 0).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from titan_core.accelerator.base import Accelerator


@dataclass
class _Entry:
    name: str
    factory: Callable[[], Accelerator]
    is_available: Callable[[], bool] | None
    priority: int
    communication_backends: tuple[str, ...] = field(default_factory=tuple)

    def available(self) -> bool:
        if self.is_available is not None:
            return bool(self.is_available())
        return self.factory().is_available()


_REGISTRY: dict[str, _Entry] = {}
_CURRENT: Accelerator | None = None


class AcceleratorError(RuntimeError):
    """The requested accelerator is unknown or unavailable."""


def register_accelerator(
    name: str,
    factory: Callable[[], Accelerator],
    is_available: Callable[[], bool] | None = None,
    priority: int = 0,
    communication_backends: tuple[str, ...] | list[str] = (),
) -> None:
    """Register (or replace) a backend under ``name``."""
    _REGISTRY[name] = _Entry(name, factory, is_available, priority, tuple(communication_backends))
    reset_accelerator()


def registered_accelerators() -> dict[str, int]:
    """Name -> priority of every registered backend."""
    return {n: e.priority for n, e in _REGISTRY.items()}


def reset_accelerator() -> None:
    """Forget the selected backend (tests, or after changing the environment)."""
    global _CURRENT
    _CURRENT = None


#: values of ``SLIME_ACCELERATOR`` that name no Titan backend but ask Titan to choose: slime
#: selects Titan's registered backend with ``titan`` (adapters/slime), ``auto`` is slime's own.
_CHOOSE_FOR_ME = ("titan", "auto")


def _requested() -> tuple[str, str] | None:
    """(backend name, the variable that asked for it), or None: choose by priority."""
    for var in ("TITAN_ACCELERATOR", "SLIME_ACCELERATOR"):
        value = os.environ.get(var, "").strip().lower()
        if var == "SLIME_ACCELERATOR" and value in _CHOOSE_FOR_ME:
            continue
        if value:
            return value, var
    for var in ("MUSA_VISIBLE_DEVICES", "MUSA_PATCH_PATH"):
        if "musa" in _REGISTRY and os.environ.get(var):
            return "musa", var
    return None


def select_accelerator_name() -> str:
    """The backend name the selection rules give, without instantiating it."""
    requested = _requested()
    if requested is not None:
        name, var = requested
        if name not in _REGISTRY:
            raise AcceleratorError(
                f"{var}={name!r} is not a registered accelerator; choose one of {sorted(_REGISTRY)}"
            )
        return name
    for entry in sorted(_REGISTRY.values(), key=lambda e: -e.priority):
        if entry.available():
            return entry.name
    raise AcceleratorError("no accelerator is available (the cpu backend was unregistered?)")


def get_accelerator() -> Accelerator:
    """The process's accelerator, chosen once and cached."""
    global _CURRENT
    if _CURRENT is None:
        name = select_accelerator_name()
        accel = _REGISTRY[name].factory()
        if not accel.is_available():
            asked = _requested()
            how = f"unset {asked[1]}" if asked else "register an available backend"
            raise AcceleratorError(
                f"accelerator {name!r} was requested but is not available on this machine; "
                f"{how} to pick one automatically, or set TITAN_ACCELERATOR"
            )
        _CURRENT = accel
    return _CURRENT


def accelerator_named(name: str) -> Accelerator:
    """A new instance of the backend registered as ``name`` (no availability check): what
    a plan made for that kind asks of it, e.g. on a driver that has no such device."""
    if name not in _REGISTRY:
        raise AcceleratorError(
            f"{name!r} is not a registered accelerator; choose one of {sorted(_REGISTRY)}"
        )
    return _REGISTRY[name].factory()


def _register_builtins() -> None:
    from titan_core.accelerator.cpu import CpuAccelerator
    from titan_core.accelerator.cuda import CudaAccelerator
    from titan_core.accelerator.musa import MusaAccelerator

    register_accelerator("musa", MusaAccelerator, priority=200, communication_backends=("mccl",))
    register_accelerator("cuda", CudaAccelerator, priority=100, communication_backends=("nccl",))
    register_accelerator("cpu", CpuAccelerator, priority=0, communication_backends=("gloo",))


_register_builtins()
