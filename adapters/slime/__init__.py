"""Titan as a slime backend.

- :func:`register`: ``titan`` in slime's accelerator registry (``SLIME_ACCELERATOR=titan``).
- :class:`TitanTrainActor`: slime's ``TrainRayActor`` trained by Titan's Megatron base, for
  ``create_training_models(..., actor_cls=TitanTrainActor)``.
- ``adapters.slime.accelerator.setup_worker``: Ray's ``worker_process_setup_hook`` that
  registers ``titan`` in every worker of a job (``adapters.slime.runtime_env``).
- ``bootstrap/``: the ``musa_patch`` / ``musa_titan`` modules slime imports on MUSA (the
  vendor's ``musa_patch`` first, then Titan's answers).
- ``python -m adapters.slime.train``: slime's loop with Titan's actor.
- ``python -m adapters.slime.launch train.py ...``: slime's own driver script, with ``titan``
  registered in it and in its Ray workers.
- ``adapters.slime.rewards`` / ``adapters.slime.generate``: hooks for ``--custom-rm-path``
  and ``--custom-generate-function-path``.

Names are loaded on first use, so ``import adapters.slime`` imports no slime module.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TitanAccelerator", "TitanTrainActor", "register"]


def register() -> None:
    """Register ``titan`` in slime's accelerator registry (idempotent)."""
    from adapters.slime.accelerator import register as _register

    _register()


def __getattr__(name: str) -> Any:
    if name == "TitanTrainActor":
        from adapters.slime.actor import TitanTrainActor

        return TitanTrainActor
    if name == "TitanAccelerator":
        from adapters.slime.accelerator import TitanAccelerator

        return TitanAccelerator
    raise AttributeError(f"module 'adapters.slime' has no attribute {name!r}")
