"""Weight sync trainer -> engines: pause, flush, update bucket by bucket, bump the version,
(colocated: resume the KV cache,) continue; then the logprob parity check
(:mod:`titan_rl.sync.parity`).

Every trainer rank calls :meth:`WeightSync.sync`. Nothing funnels through one rank: each
pipeline stage's source rank sends its stage's weights and each EP rank its own experts
(:class:`~titan_core.models.hf.SendRole`), straight to the engines; trainer rank 0 coordinates
(pause, commit, version, resume) and gathers what the senders saw (:mod:`titan_rl.sync.control`).
An engine TP rank gets its own payload (``tensor``), group rank (``distributed``) or buffer
(``mooncake``). An engine that fails during a sync never serves the half
update as new: it keeps its old ``weight_version``; if it had already applied buckets, it is
restored from the last full version on disk when one is known (the engine's start-up weights
or the last disk sync), and otherwise left paused (:mod:`titan_rl.sync.restore`). Either way
:class:`WeightSyncError` names it.

A sync is a sequence of calls that must all reach one server process, so its calls are never
retried: a call retried after a connection error could reach a restarted server that missed
the earlier ones (and, say, label its start-up weights with the new version). With
``supervised`` engines (the GRPO job: a supervisor restarts a dead engine and the driver
resyncs it, titan_rl/actors/recovery.py) an engine that becomes unreachable during a sync is
*lost*, not a failure: the others take the new weights and ``sync/engines_lost`` counts it.
The parity probe only scores engines that report the synced version before and after it.

:meth:`WeightSync.resync` sends the trainer's weights to some engines alone (ones their
supervisor restarted on the start-up weights), aborting what they were generating.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_core.models.hf import HFBridge, SendRole
from titan_rl.rollout import ClientOptions, make_engine_client
from titan_rl.rollout.engine_api import EngineUnavailableError, RetryPolicy
from titan_rl.rollout.engine_clients import DEFAULT_CLIENT
from titan_rl.sync import parity
from titan_rl.sync.config import SyncConfig
from titan_rl.sync.control import Report, Sender, TrainerRanks
from titan_rl.sync.parity import ParityError
from titan_rl.sync.restore import RestorePoints, take_lost
from titan_rl.sync.transports import TRANSPORTS, Engine, Failures, Transport, each_engine
from titan_rl.sync.transports.base import describe
from titan_rl.wire.bucket import NamedTensors, bucket_nbytes

__all__ = ["KV_CACHE_TAGS", "NO_RETRY", "ParityError", "WeightSync", "WeightSyncError"]

log = logging.getLogger(__name__)

#: what a colocated engine gets back after the new weights are loaded (SGLang's tags)
KV_CACHE_TAGS = ["kv_cache", "cuda_graph"]


class WeightSyncError(RuntimeError):
    """One or more engines did not take the new weights; ``failures`` maps URL -> reason."""

    def __init__(self, failures: dict[str, str], version: str) -> None:
        self.failures = failures
        lines = "\n  ".join(f"{url}: {msg}" for url, msg in failures.items())
        super().__init__(
            f"weight sync to version {version} failed on {len(failures)} engine(s):\n  {lines}"
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class WeightSync:
    """Pushes a megatron model's weights to SGLang-API engines as HF tensors."""

    def __init__(
        self,
        cfg: SyncConfig,
        engine_urls: list[str],
        hf_config: dict[str, Any] | str | Path,
        *,
        api_key: str | None = None,
        device: torch.device | None = None,
        supervised: bool = False,
        client: str = DEFAULT_CLIENT,
        agents: list[str] | None = None,
    ) -> None:
        """``client``: the engine client's name (``engines.client``); ``agents``: the Mooncake
        agents the GRPO job started beside the engines, one per engine in their order
        (``sync.transport=mooncake`` with ``sync.mooncake.agents`` empty)."""
        if not engine_urls:
            raise ValueError("WeightSync needs at least one engine URL")
        if agents is not None:
            cfg = cfg.with_agents(agents)
        problem = cfg.settings.connect_problem(len(engine_urls))
        if problem:
            raise ValueError(problem)
        self.cfg = cfg
        self.bridge = HFBridge(hf_config)
        self.ranks = TrainerRanks()
        #: the trainer rank that coordinates the sync and gets its metrics
        self.dst = self.ranks.COORDINATOR
        #: this rank's part in the sync (set on the first sync: parallel_state is up by then)
        self._role: SendRole | None = None
        self._sender: Sender | None = None
        #: what this rank sent in the last sync (bytes, buckets, failures it saw)
        self.last_report = Report()
        self.supervised = supervised
        self.api_key = api_key
        self.client = client
        self.engine_urls = list(engine_urls)
        self.device = device or torch.device("cpu")
        self.num_syncs = 0
        self.version: str | None = None
        #: what each engine goes back to when a sync fails on it
        self.restore = RestorePoints(cfg.initial_version)
        self.probe = parity.probe_batch(
            cfg.probe_num_sequences, cfg.probe_length, self.bridge.vocab_size, cfg.probe_seed
        )
        self._transport: Transport | None = None
        self._warming: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: _Clients | None = None
        #: engines restarted since the last sync (coordinator): senders drop their groups
        self._forgotten: set[str] = set()

    # ---- set-up ----------------------------------------------------------------------------
    def _get_transport(self) -> Transport:
        """``sync.transport``'s class from the table, built from its section."""
        if self._transport is None:
            cls = TRANSPORTS[self.cfg.transport]
            self._transport = cls(self.cfg.settings, self.device, self.cfg.timeout_s)
        return self._transport

    def warm_up(self) -> None:
        """Build the transport and let it do ahead, on a thread, what the first sync would
        otherwise wait for (:meth:`Transport.warm`): the engines' first rollout runs
        meanwhile. The first sync waits for it to end."""
        transport = self._get_transport()

        def warm() -> None:
            try:
                transport.warm()
            except Exception as e:  # the first sync does it, and reports what fails
                log.warning("weight sync warm-up failed (%s: %s)", type(e).__name__, e)

        self._warming = threading.Thread(target=warm, name="weight-sync-warm-up", daemon=True)
        self._warming.start()

    def _warmed(self) -> None:
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def _engines(self) -> list[Engine]:
        """Clients kept for the whole run (connections and TLS set-up once, not per sync)."""
        if self._clients is None:
            self._clients = _Clients(
                self.engine_urls, self.api_key, self.cfg.timeout_s, self.client
            )
        return self._clients.engines

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    # ---- the sync ------------------------------------------------------------------------------
    def sync(self, chunks: list[Any], step: int, version: str | None = None) -> dict[str, float]:
        """Push ``chunks``' weights to every engine as ``version`` (default: ``step``).

        Returns the metrics (on trainer rank 0; an empty dict elsewhere). Raises
        :class:`WeightSyncError` naming failed engines, :class:`ParityError` in strict mode.
        """
        version = str(step if version is None else version)
        metrics = self._push(chunks, version, None)
        self.num_syncs += 1
        if self.cfg.check_every and (self.num_syncs - 1) % self.cfg.check_every == 0:
            metrics.update(self.check(chunks, version=version))
        return metrics

    def resync(self, chunks: list[Any], urls: list[str], version: str) -> dict[str, float]:
        """Send the weights the trainer holds to the engines at ``urls`` alone, as ``version``
        (restarted engines; the others keep serving). What those engines were generating is
        aborted (the requests' senders refuse it by its old version and send it again).

        Every trainer rank calls this; the parity check, when ``sync.check_every`` is on, runs
        on those engines (``resync/logprob_abs_diff_*``). Raises WeightSyncError, ParityError
        (strict) as :meth:`sync` does.
        """
        unknown = [u for u in urls if u not in self.engine_urls]
        if unknown:
            raise ValueError(f"resync: {unknown} are not among the engines {self.engine_urls}")
        if not urls:
            return {}
        t0 = time.perf_counter()
        metrics = {
            f"resync/{k.removeprefix('sync/')}": v
            for k, v in self._push(chunks, version, urls, restarted=True).items()
        }
        if self.cfg.check_every:
            engines = [e for e in self._engines() if e.url in urls] if _rank() == self.dst else None
            stats = self.check(chunks, engines, version)
            metrics.update({f"resync/{k.removeprefix('sync/')}": v for k, v in stats.items()})
        if _rank() == self.dst:
            log.warning(
                "gave %s the trainer's weights as version %s in %.2fs",
                urls, version, time.perf_counter() - t0,
            )  # fmt: skip
        return metrics

    def _forget(self, engines: list[Engine]) -> None:
        """A restarted engine holds no state of earlier syncs: no restore point but its
        start-up weights, and no process group (every sender rebuilds its group with it at the
        next sync: ``forget`` in the plan)."""
        for e in engines:
            self.restore.forget(e.url)
            self._forgotten.add(e.url)

    def _setup_roles(self) -> tuple[SendRole, Sender | None]:
        if self._role is None:
            self._role = SendRole.current(self.bridge.has_experts())
            senders = self.ranks.all_gather((self._role.sends, self._role.name))
            names = [name for sends, name in senders if sends]
            if self._role.sends:
                self._sender = Sender(self._role.name, names.index(self._role.name), len(names))
        return self._role, self._sender

    def _push(
        self,
        chunks: list[Any],
        version: str,
        urls: list[str] | None,
        restarted: bool = False,
    ) -> dict[str, float]:
        """Pause (coordinator), send each rank's part (senders; every rank runs the export's
        gathers), then commit and resume (coordinator). Metrics on the coordinator."""
        self._warmed()
        role, sender = self._setup_roles()
        dtype = getattr(torch, self.cfg.dtype) if self.cfg.dtype else None
        out = self._get_transport().before_export(chunks) if role.sends else None
        buckets = self.bridge.export_shard(
            chunks, self.cfg.bucket_bytes, dtype=dtype, views=True, out=out
        )
        engines: list[Engine] = []
        plan = None
        if self.ranks.coordinator:
            engines = self._engines() if urls is None else [
                e for e in self._engines() if e.url in urls
            ]  # fmt: skip
            if restarted:
                self._forget(engines)
            plan = self._run(self._prepare(engines, version, restarted))
        plan = self.ranks.share(plan)
        if sender is not None:
            report = self._run(self._send_part(buckets, plan, sender))
        else:
            for _ in buckets:  # take part in the gathers
                pass
            report = Report()
        self.last_report = report
        reports = self.ranks.gather(report)
        if not self.ranks.coordinator:
            return {}
        assert reports is not None
        return self._run(self._finish(engines, plan, reports, version, restarted))

    async def _prepare(
        self, engines: list[Engine], version: str, restarted: bool
    ) -> dict[str, Any]:
        """Coordinator: pause and flush, learn each engine's TP size; the plan for the
        senders."""
        tr = self._get_transport()
        for e in engines:
            e.applied = 0
            e.extra.pop("left_paused", None)
        failures: dict[str, tuple[str, bool]] = {}

        def fail(found: Failures, stage: str) -> None:
            for url, exc in found.items():
                failures.setdefault(
                    url, (f"{stage}: {describe(exc)}", isinstance(exc, EngineUnavailableError))
                )

        t0 = time.perf_counter()
        await self.restore.remember(engines)
        fail(await each_engine(engines, self._learn_server_info), "server info")
        live = [e for e in engines if e.url not in failures]
        fail(await _pause(live, "abort" if restarted else self.cfg.pause_mode), "pause")
        live = [e for e in live if e.url not in failures]
        fail(await tr.prepare(live, version), "prepare")
        forget, self._forgotten = sorted(self._forgotten), set()
        return {
            "urls": [e.url for e in live if e.url not in failures],
            "tp": {e.url: e.tp_size for e in engines},
            "failures": failures,
            "forget": forget,
            "version": version,
            "started": t0,
        }

    @staticmethod
    async def _learn_server_info(e: Engine) -> None:
        """Once per engine: its TP size, and whether it keeps a prefix cache to flush."""
        if e.tp_size == 0:
            info = await e.client.get_server_info()
            e.tp_size = int(info.get("tp_size") or 1)
            e.prefix_cache = not info.get("disable_radix_cache", False)

    async def _send_part(
        self, buckets: Iterator[NamedTensors], plan: dict[str, Any], sender: Sender
    ) -> Report:
        """A sender: this rank's buckets to every engine of the plan."""
        tr = self._get_transport()
        tr.sender = sender
        report = Report()
        engines = [e for e in self._engines() if e.url in plan["urls"]]
        for e in engines:
            e.applied = 0
            e.tp_size = plan["tp"][e.url]
        failed: dict[str, str] = {}

        def fail(found: Failures, stage: str) -> None:
            for url, exc in found.items():
                if url not in failed:
                    failed[url] = stage
                    report.failures[url] = (
                        f"{stage} (from {sender.name}): {describe(exc)}",
                        isinstance(exc, EngineUnavailableError),
                    )

        t0 = time.perf_counter()
        fail(await tr.begin(engines, plan["version"], plan["forget"]), "begin")
        report.bytes, report.buckets = await self._send_buckets(tr, engines, buckets, failed, fail)
        await tr.end(engines)
        report.transfer_s = time.perf_counter() - t0
        report.applied = {e.url: e.applied for e in engines}
        return report

    async def _finish(
        self,
        engines: list[Engine],
        plan: dict[str, Any],
        reports: list[Report],
        version: str,
        restarted: bool,
    ) -> dict[str, float]:
        """Coordinator: merge the senders' reports, commit, version, recover, resume."""
        tr = self._get_transport()
        failures: dict[str, str] = {}
        unreachable: set[str] = set()

        def note(url: str, msg: str, gone: bool) -> None:
            failures.setdefault(url, msg)
            if gone:
                unreachable.add(url)

        def fail(found: Failures, stage: str) -> None:
            for url, exc in found.items():
                note(url, f"{stage}: {describe(exc)}", isinstance(exc, EngineUnavailableError))

        for url, (msg, gone) in plan["failures"].items():
            note(url, msg, gone)
        for r in reports:
            for url, (msg, gone) in r.failures.items():
                note(url, msg, gone)
        by_url = {e.url: e for e in engines}
        for e in engines:  # the coordinator's own sends counted once, from its report
            e.applied = 0
        for r in reports:
            for url, n in r.applied.items():
                by_url[url].applied += n
        live = [e for e in engines if e.url not in failures]
        fail(await tr.commit(live, version), "load")
        transfer_s = max((r.transfer_s for r in reports), default=0.0)
        live = [e for e in engines if e.url not in failures]
        fail(await each_engine(live, lambda e: e.client.update_weight_version(version)), "version")
        lost = self._lost(engines, failures, unreachable, version)
        for e in engines:
            if e.url in lost:
                continue
            if e.url in failures:
                failures[e.url] = await self.restore.recover(e, tr, failures[e.url])
            else:
                self.restore.synced(e.url, tr.restore_path(version))
        serving = [e for e in engines if not e.extra.get("left_paused") and e.url not in lost]
        if self.cfg.resume_kv_cache and not restarted:  # colocated: the KV cache comes back
            fail(
                await each_engine(
                    serving, lambda e: e.client.resume_memory_occupation(KV_CACHE_TAGS)
                ),
                "resume kv_cache",
            )
        await each_engine(serving, lambda e: e.client.continue_generation())
        if failures:
            raise WeightSyncError(failures, version)
        if not restarted:
            self.version = version
        sent = [r.bytes for r in reports if r.buckets]
        nbytes = sum(sent)
        return {
            "sync/time_s": time.perf_counter() - plan["started"],
            "sync/transfer_s": transfer_s,
            "sync/bytes": float(nbytes),
            "sync/bytes_max_rank": float(max(sent, default=0)),
            "sync/senders": float(len(sent)),
            "sync/buckets": float(sum(r.buckets for r in reports)),
            "sync/gbps": nbytes / transfer_s / 1e9 if transfer_s > 0 else 0.0,
            **({"sync/engines_lost": float(len(lost))} if lost else {}),
        }

    def _lost(
        self, engines: list[Engine], failures: dict[str, str], unreachable: set[str], version: str
    ) -> set[str]:
        """Supervised engines that became unreachable during the sync: taken out of
        ``failures`` (their supervisor restarts them, the driver resyncs them) and forgotten
        (a restarted engine holds no state of this run's syncs)."""
        if not self.supervised:
            return set()
        lost = take_lost(failures, unreachable, version)
        self._forget([e for e in engines if e.url in lost])
        return lost

    @staticmethod
    async def _send_buckets(
        tr: Transport,
        engines: list[Engine],
        buckets: Iterator[NamedTensors],
        failures: dict[str, Any],
        fail: Callable[[Failures, str], None],
    ) -> tuple[int, int]:
        """Every bucket to every live engine; a pipelined transport keeps two in flight."""
        nbytes, nbuckets = 0, 0
        limit = 2 if tr.pipelined else 1
        inflight: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        for bucket in buckets:  # keep iterating after failures: other ranks are gathering
            live = [e for e in engines if e.url not in failures]
            nbytes += bucket_nbytes(bucket)
            nbuckets += 1
            if not live:
                continue
            task = asyncio.ensure_future(tr.send(live, bucket))
            inflight.append((nbuckets, task))
            await tr.submitted(task)  # before the next export holds the event loop
            while len(inflight) >= limit:
                k, task = inflight.popleft()
                fail(await task, f"bucket {k}")
        while inflight:
            k, task = inflight.popleft()
            fail(await task, f"bucket {k}")
        return nbytes, nbuckets

    # ---- parity ----------------------------------------------------------------------------------
    def check(
        self, chunks: list[Any], engines: list[Engine] | None = None, version: str | None = None
    ) -> dict[str, float]:
        """The parity check (:mod:`titan_rl.sync.parity`) on every engine (or ``engines``):
        mean/max |diff| over all; with ``version``, only engines that report it before and
        after their probe are scored (``sync/parity_skipped`` counts the rest).

        Every trainer rank must call this (the trainer side runs megatron's forward-only
        schedule over TP / PP / VPP); the metrics come back on ``dst``, ``{}`` elsewhere.
        """
        ours = parity.trainer_logprobs(chunks, self.probe, self.bridge.vocab_size)
        if _rank() != self.dst:
            return {}
        scored = self._run(parity.score_engines(engines or self._engines(), self.probe, version))
        return parity.verdict(self.cfg, ours, scored, version)

    def close(self) -> None:
        self._warmed()
        if self._transport is not None:
            engines = self._clients.engines if self._clients is not None else []
            self._run(self._transport.destroy(engines))
            self._transport.close()
            self._transport = None
        if self._clients is not None:
            self._run(self._clients.aclose())
            self._clients = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None


#: a sync's calls go to one server process or fail (see the module docstring)
NO_RETRY = RetryPolicy(timeout_s=0.0, max_retries=0)


class _Clients:
    def __init__(self, urls: list[str], api_key: str | None, timeout_s: float, client: str) -> None:
        options = ClientOptions(api_key=api_key, control_timeout_s=timeout_s, retry=NO_RETRY)
        self.engines = [
            Engine(u, make_engine_client(u, options, client=client), i) for i, u in enumerate(urls)
        ]

    async def aclose(self) -> None:
        await asyncio.gather(*(e.client.aclose() for e in self.engines))


async def _pause(engines: list[Engine], mode: str) -> Failures:
    """Pause generation on ``engines``, then flush the prefix caches of those that keep one
    (with requests still held, as ``retract`` and ``in_place`` hold them, the flush is
    refused and the cache stays: SGLang's behaviour)."""

    async def one(e: Engine) -> None:
        await e.client.pause_generation(mode)
        if e.prefix_cache:
            await e.client.flush_cache()

    return await each_engine(engines, one)
