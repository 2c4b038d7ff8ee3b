"""``sync.transport: mooncake``: Mooncake's TransferEngine writes each bucket into a buffer
registered by an agent beside each engine (``python -m titan_rl.sync.mooncake_agent``),
which then loads it. The GRPO job starts the agents itself (each engine's actor, beside its
engine) unless ``sync.mooncake.agents`` names them."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from typing import Literal

import httpx
import torch
from pydantic import Field, PositiveInt

from titan_core.net import NODE_IP_ENV, client_tls, host_address, node_address
from titan_rl.actors.config import MooncakeAgentLaunch
from titan_rl.sync.transports.base import Engine, Failures, Transport, TransportSection, each_engine
from titan_rl.sync.transports.staging import Staging
from titan_rl.wire.bucket import NamedTensors, bucket_nbytes, dtype_name, flatten_into


class MooncakeSync(TransportSection):
    """``sync.mooncake``: TransferEngine writes into buffers registered by an agent beside
    each engine (``python -m titan_rl.sync.mooncake_agent``)."""

    #: one agent URL per engine, in the engines' order, each started by hand beside its
    #: engine; empty: the GRPO job starts one beside each engine (on its host, a free port);
    #: the slime / miles adapters need them given.
    agents: list[str] = Field(default_factory=list)
    #: the TransferEngine's protocol.
    protocol: Literal["tcp", "rdma"] = "tcp"
    #: the RDMA device ("": Mooncake's choice).
    device: str = ""
    #: this trainer's address as the agents reach it; "auto": each trainer sender's own
    #: node address (TITAN_NODE_IP where set; its Ray node's IP in a Ray actor; else
    #: torchrun's --local-addr or the host's outward address).
    host: str = "auto"
    #: the receive buffer of each agent the GRPO job starts (one region per trainer sender:
    #: a pipeline stage's, or an EP rank's on MoE models). None: sync.bucket_bytes x the
    #: senders; more where one tensor is larger than sync.bucket_bytes (it travels alone).
    #: Only with agents empty (an agent started by hand has its --buffer-bytes).
    buffer_bytes: PositiveInt | None = None

    def chosen_problem(self) -> str | None:
        if self.agents and self.buffer_bytes is not None:
            return (
                "sync.mooncake.buffer_bytes sizes the agents the GRPO job starts, but "
                "sync.mooncake.agents names agents started by hand (their --buffer-bytes sizes "
                "them); unset one of the two"
            )
        return None

    def engines_problem(self, num_engines: int, key: str | None = None) -> str | None:
        if not self.agents or len(self.agents) == num_engines:
            return None  # none given: the job starts one per engine
        engines = f"{key}={num_engines}" if key else f"{num_engines} engines"
        return (
            f"sync.mooncake.agents has {len(self.agents)} URLs for {engines}; give one agent "
            "per engine, in the engines' order"
        )

    def connect_problem(self, num_engines: int) -> str | None:
        if not self.agents:
            return (
                "sync.transport=mooncake needs one Mooncake agent per engine: the GRPO job "
                "(python -m titan_rl.grpo) starts them beside its engines; elsewhere give "
                "sync.mooncake.agents (start `python -m titan_rl.sync.mooncake_agent "
                "--engine-url ...` beside each engine)"
            )
        return self.engines_problem(num_engines)

    def job_agent(self, bucket_bytes: int, senders: int) -> MooncakeAgentLaunch | None:
        """The agent each engine's actor starts beside its engine in the GRPO job, with a
        region of ``bucket_bytes`` for each of the trainer's ``senders`` (None: agents
        given)."""
        if self.agents:
            return None
        return MooncakeAgentLaunch(
            buffer_bytes=self.buffer_bytes or bucket_bytes * senders,
            protocol=self.protocol,
            device=self.device,
        )

    def machine_problem(self) -> str | None:
        if importlib.util.find_spec("mooncake") is None:
            return (
                "sync.transport=mooncake needs the mooncake package (pip install "
                "mooncake-transfer-engine); or choose another sync.transport"
            )
        return None


class MooncakeTransport(Transport):
    """Trainer writes each bucket into the agent's registered buffer, then the agent loads it."""

    name = "mooncake"
    settings_class = MooncakeSync
    summary = "Mooncake TransferEngine writes into buffers registered by an agent per engine"

    def __init__(self, settings: MooncakeSync, device: torch.device, timeout_s: float) -> None:
        super().__init__(settings, device, timeout_s)
        from mooncake.engine import TransferEngine

        mc = self.mc = settings
        self.host = sender_host(mc.host)
        self.te = TransferEngine()
        rc = self.te.initialize(self.host, "P2PHANDSHAKE", mc.protocol, mc.device)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({self.host!r}, P2PHANDSHAKE, "
                f"{mc.protocol!r}) failed with {rc}; set sync.mooncake.host (now "
                f"{mc.host!r}) to an address of this trainer's node"
            )
        self.staging = Staging(torch.device("cpu"), shared=False)
        self._registered: tuple[int, int] | None = None
        self.http = httpx.AsyncClient(timeout=timeout_s, verify=client_tls())

    def _source(self, need: int) -> torch.Tensor:
        buf = self.staging.get(need)
        key = (buf.data_ptr(), buf.numel())
        if self._registered != key:
            if self._registered is not None:
                self.te.unregister_memory(self._registered[0])
            if self.te.register_memory(*key) != 0:
                raise RuntimeError("Mooncake could not register the trainer's staging buffer")
            self._registered = key
        return buf

    async def begin(self, engines: list[Engine], version: str, forget: list[str]) -> Failures:
        async def one(e: Engine) -> None:
            agent = self.mc.agents[e.index]
            r = await self.http.get(f"{agent}/info")
            r.raise_for_status()
            e.extra["agent"], e.extra["info"] = agent, r.json()

        return await each_engine(engines, one)

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        nbytes = bucket_nbytes(bucket)
        flat, meta = flatten_into(self._source(nbytes), bucket)
        n = self.sender.count

        async def one(e: Engine) -> None:
            # the agent's buffer is split in one region per sender: they write concurrently
            info = e.extra["info"]
            region = info["size"] // n
            if nbytes > region:
                raise RuntimeError(
                    f"bucket of {nbytes} bytes exceeds this sender's {region}-byte region of the "
                    f"agent's buffer ({n} senders); give the agents >= {n} x {nbytes} bytes: "
                    "sync.mooncake.buffer_bytes (agents the GRPO job starts), or --buffer-bytes "
                    "(agents started by hand)"
                )
            base = self.sender.index * region
            rows = [
                [m.name, list(m.shape), dtype_name(m.dtype), base + m.start_idx, base + m.end_idx]
                for m in meta
            ]
            rc = await asyncio.to_thread(
                self.te.transfer_sync_write, info["session"], flat.data_ptr(),
                info["addr"] + base, nbytes,
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"Mooncake write to {info['session']} failed ({rc})")
            r = await self.http.post(f"{e.extra['agent']}/load", json={"metadata": rows})
            data = r.json()
            if r.status_code != 200 or not data.get("success", False):
                raise RuntimeError(f"agent {e.extra['agent']}: {data.get('message', r.text)}")
            e.applied += 1

        return await each_engine(engines, one)

    def close(self) -> None:
        if self._registered is not None:
            self.te.unregister_memory(self._registered[0])
            self._registered = None


def sender_host(host: str) -> str:
    """``sync.mooncake.host`` as this sender's TransferEngine binds and advertises it: "auto"
    is this process's node address: ``TITAN_NODE_IP`` where set (the GRPO job sets it for
    its trainer ranks on a cluster), its Ray node's IP in a Ray actor, else
    :func:`~titan_core.net.node_address`, else :func:`~titan_core.net.host_address`."""
    if host != "auto":
        return host
    given = node_address() if os.environ.get(NODE_IP_ENV, "").strip() else None
    if given:
        return given
    ray = sys.modules.get("ray")  # a Ray actor has it imported; nothing else needs it
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return node_address() or host_address()
