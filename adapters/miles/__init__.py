"""Titan as a miles backend.

- :class:`TitanTrainRayActor`: miles' ``TrainRayActor`` trained by Titan's Megatron base
  (``adapters.miles.actor``).
- ``python -m adapters.miles.train``: miles' loop with Titan's actor, put into miles'
  ``RayTrainGroup`` by one documented substitution (``adapters.miles.train.titan_train_actors``).
- ``adapters.miles.generate`` / ``.data_source`` / ``.rollout``: the rollout side of that
  driver over Titan's engines (miles' own modules there import sglang).

Names are loaded on first use, so ``import adapters.miles`` imports no miles module.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TitanTrainRayActor"]


def __getattr__(name: str) -> Any:
    if name == "TitanTrainRayActor":
        from adapters.miles.actor import TitanTrainRayActor

        return TitanTrainRayActor
    raise AttributeError(f"module 'adapters.miles' has no attribute {name!r}")
