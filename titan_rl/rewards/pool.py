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
would copy mid-state; a forkserver forks from a clean process, and faster than spawn. The
forkserver preloads this module (and math-verify for that reward), and a worker does not
import the driver's ``__main__``, which multiprocessing would run again in every child
(``python -m titan_rl.grpo``: torch and the config stack, ~2 s on 2 CPU cores). Nothing a
worker runs lives there: its functions are this module's, the reward is imported from
``reward.custom_path``. So replacing a worker killed by a timeout costs the fork and the
reward module's import (0.11-0.12 s measured with bench/reward_worker_replacement.py on 2
shared cores, against 1.9-3.1 s before), not a second start of the driver.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import io
import os
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing.context import ForkServerContext, ForkServerProcess, set_spawning_popen
from typing import Any

from pebble import ProcessExpired, ProcessPool

from titan_rl.rewards.config import RewardConfig
from titan_rl.rewards.errors import InvalidRewardError, RewardError, RewardTimeoutsError
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


#: the worker's event loop for ``async def`` hooks (made on first use, kept)
_HOOK_LOOP: asyncio.AbstractEventLoop | None = None


def _call_hook(path: str, args: tuple[Any, ...]) -> Any:
    """In a worker: the function at ``path`` (``module.function``) called with ``args``; an
    ``async def`` one run to completion on the worker's own event loop."""
    global _HOOK_LOOP
    module, _, name = path.rpartition(".")
    out = getattr(importlib.import_module(module), name)(*args)
    if inspect.isawaitable(out):
        if _HOOK_LOOP is None:
            _HOOK_LOOP = asyncio.new_event_loop()
        out = _HOOK_LOOP.run_until_complete(out)
    return out


#: what multiprocessing sends a child to run its parent's main module again
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")


class _WorkerPopen(popen_forkserver.Popen):
    """A forkserver child that does not run the parent's ``__main__``: CPython 3.11's
    ``popen_forkserver.Popen._launch`` with the main module left out of the data the child
    prepares from (everything else, sys.path and the working directory included, as sent)."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        for key in _MAIN_KEYS:
            prep_data.pop(key, None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        # a duplicate of the data pipe's write end: the child's sentinel of its parent
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _WorkerProcess(ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _WorkerPopen:
        return _WorkerPopen(process_obj)


class _WorkerContext(ForkServerContext):
    """The forkserver context whose processes skip the parent's main module."""

    Process = _WorkerProcess


def preloaded_modules(cfg: RewardConfig) -> list[str]:
    """What the forkserver imports once for every worker it forks: this module (pebble, the
    scorer, pydantic) and math-verify (sympy: seconds) for that reward. Never the user's
    reward module: a worker imports it itself, so a client it opens is the worker's own."""
    return [__name__, *(["math_verify"] if cfg.type == "math_verify" else [])]


def _where(cfg: RewardConfig) -> str:
    """The reward as messages name it: its config key."""
    if cfg.type == "custom":
        return f"reward.custom_path {cfg.custom_path}"
    return f"reward.type={cfg.type}"


def timeouts_note(
    cfg: RewardConfig, timeouts: int, scored: int, what: str, where: str | None = None
) -> str | None:
    """A warning line when more than ``reward.max_timeout_share`` of the ``scored`` reward
    calls of ``what`` (a step, an evaluation) timed out, else None; under
    ``reward.on_timeouts=stop`` a RewardTimeoutsError naming the key instead. ``where``: the
    reward as the user chose it (default: its config key)."""
    if not scored or timeouts <= cfg.max_timeout_share * scored:
        return None
    msg = (
        f"{what}: {timeouts} of {scored} reward calls ({where or _where(cfg)}) ran past reward.timeout_s="
        f"{cfg.timeout_s:g} and scored reward.timeout_score={cfg.timeout_score:g}, more than "
        f"reward.max_timeout_share={cfg.max_timeout_share:g}"
    )
    if cfg.on_timeouts == "stop":
        raise RewardTimeoutsError(
            f"{msg}: stopping (reward.on_timeouts=stop). Fix the reward (a stuck remote "
            "model or sandbox?), raise reward.timeout_s, or set reward.on_timeouts=warn"
        )
    return f"{msg}; the run goes on (reward.on_timeouts=stop stops it)"


class RewardPool:
    """Scores samples concurrently in worker processes (started on first use).

    A call past ``timeout_s`` scores ``timeout_score`` with status "timeout"; an invalid
    value raises InvalidRewardError, or with ``on_invalid="drop"`` comes back with status
    "invalid"; anything else the reward raises, or a worker's death, is a RewardError.
    """

    def __init__(self, cfg: RewardConfig, preload: Sequence[str] = ()) -> None:
        """``preload``: more modules the workers start with imported (a framework's reward
        hub for :meth:`call_hook`: imported per worker, a heavy one would eat each call's
        ``reward.timeout_s``)."""
        self.cfg = cfg
        self.preload = list(preload)
        self._pool: ProcessPool | None = None

    def _started(self) -> ProcessPool:
        if self._pool is None:
            ctx = _WorkerContext()
            # workers fork with these imported (no effect once the forkserver runs)
            ctx.set_forkserver_preload([*preloaded_modules(self.cfg), *self.preload])
            self._pool = ProcessPool(
                max_workers=self.cfg.num_workers,
                initializer=_init_worker,
                initargs=(self.cfg.model_dump(mode="json"),),
                context=ctx,
            )
        return self._pool

    def _where(self) -> str:
        return _where(self.cfg)

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

    async def call_hook(self, path: str, *args: Any, where: str, sample: str) -> tuple[bool, Any]:
        """A framework's reward hook (slime's / miles' rm hub, ``path`` = ``module.function``)
        called with ``args`` in a worker under ``reward.timeout_s``: ``(True, its value)``,
        or ``(False, None)`` when the call ran past the timeout (the worker is replaced).
        What the hook raises, or a worker's death, is a RewardError naming ``where`` (the
        flag that chose the reward) and ``sample``. The value is the caller's to check; what
        the hook changes on its arguments stays in the worker."""
        future = self._started().schedule(_call_hook, args=(path, args), timeout=self.cfg.timeout_s)
        try:
            return True, await asyncio.wrap_future(future)
        except FutureTimeout:
            return False, None
        except ProcessExpired as e:
            raise RewardError(
                f"{where}: the reward worker died (exit code {e.exitcode}) scoring {sample}"
            ) from None
        except BrokenProcessPool as e:
            raise RewardError(f"{where}: the reward workers cannot start: {e}") from e
        except Exception as e:  # the hook's own error
            raise RewardError(f"{where} raised {type(e).__name__}: {e} scoring {sample}") from e

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
