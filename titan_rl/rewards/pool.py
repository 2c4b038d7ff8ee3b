"""Reward calls off the event loop: worker processes, each call under ``reward.timeout_s``.

Why processes: a reward that blocks (a stuck remote reward model, a sandbox that never
returns, sympy stuck in C code) cannot be stopped in a thread, and on the driver's event loop
it stops every rollout. A worker process can be killed: pebble's ProcessPool kills a worker
whose call runs past its timeout and starts a fresh one, so a stuck call costs one worker for
``timeout_s`` and never blocks the calls after it.

``async def`` custom rewards run in the workers too, on each worker's own event loop.
``asyncio.wait_for`` on the driver's loop could cancel one only while it awaits; one that
blocks (a synchronous HTTP call inside an ``async def``) would stall the loop and with it
every rollout, beyond any timeout. In a worker it is killed like a sync one. The price is
concurrency: one call per worker at a time (``reward.num_workers``).

Workers start from a forkserver: the driver runs Ray and HTTP threads, which a plain fork
would copy mid-state; a forkserver forks from a clean process, and faster than spawn.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pebble import ProcessExpired, ProcessPool

from titan_rl.rewards.config import RewardConfig
from titan_rl.rewards.errors import InvalidRewardError, RewardError
from titan_rl.rewards.scorer import RewardResult, RewardScorer, describe_sample

#: the worker process's scorer, built once by ``_init_worker``
_SCORER: RewardScorer | None = None


def _init_worker(cfg: dict[str, Any]) -> None:
    global _SCORER
    _SCORER = RewardScorer(RewardConfig.model_validate(cfg))
    _SCORER.warm_up()  # before the first call's clock starts


def _score(prompt: str, response: str, label: Any, metadata: dict | None) -> RewardResult:
    assert _SCORER is not None, "reward worker not initialized"
    return _SCORER.score_one(prompt, response, label, metadata)


class RewardPool:
    """Scores samples concurrently in worker processes (started on first use).

    A call past ``timeout_s`` scores ``timeout_score`` with status "timeout"; an invalid
    value raises InvalidRewardError, or with ``on_invalid="drop"`` comes back with status
    "invalid"; anything else the reward raises, or a worker's death, is a RewardError.
    """

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self._pool: ProcessPool | None = None

    def _started(self) -> ProcessPool:
        if self._pool is None:
            ctx = multiprocessing.get_context("forkserver")
            # workers fork with this module imported (no effect once the forkserver runs)
            ctx.set_forkserver_preload([__name__])
            self._pool = ProcessPool(
                max_workers=self.cfg.num_workers,
                initializer=_init_worker,
                initargs=(self.cfg.model_dump(mode="json"),),
                context=ctx,
            )
        return self._pool

    def _where(self) -> str:
        if self.cfg.type == "custom":
            return f"reward.custom_path {self.cfg.custom_path}"
        return f"reward.type={self.cfg.type}"

    async def score_one(
        self, prompt: str, response: str, label: Any, metadata: dict | None = None
    ) -> RewardResult:
        cfg = self.cfg
        future = self._started().schedule(
            _score, args=(prompt, response, label, metadata), timeout=cfg.timeout_s
        )
        try:
            # cancelling this coroutine cancels the call (pebble stops a running one)
            return await asyncio.wrap_future(future)
        except FutureTimeout:
            return RewardResult(cfg.timeout_score, False, False, status="timeout")
        except InvalidRewardError as e:
            if cfg.on_invalid == "error":
                raise InvalidRewardError(str(e)) from None  # without the worker's traceback
            return RewardResult(0.0, False, False, extra={"error": str(e)}, status="invalid")
        except ProcessExpired as e:
            raise RewardError(
                f"{self._where()}: the reward worker died (exit code {e.exitcode}) scoring "
                f"{describe_sample(prompt, response, label)}"
            ) from None
        except BrokenProcessPool as e:
            raise RewardError(f"{self._where()}: the reward workers cannot start: {e}") from e
        except RewardError:
            raise
        except Exception as e:  # the reward function's own error
            raise RewardError(
                f"{self._where()} raised {type(e).__name__}: {e} scoring "
                f"{describe_sample(prompt, response, label)}"
            ) from e

    async def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict | None],
    ) -> list[RewardResult]:
        """Results of parallel lists, scored concurrently (in the input order)."""
        calls = zip(prompts, responses, labels, metadatas, strict=True)
        return list(await asyncio.gather(*(self.score_one(*c) for c in calls)))

    def close(self) -> None:
        """Stop the workers (a running call is killed)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()
