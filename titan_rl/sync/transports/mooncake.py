"""``sync.transport: mooncake``: Mooncake's TransferEngine writes each bucket into a buffer
registered by an agent beside each engine (``python -m titan_rl.sync.mooncake_agent``),
which then loads it."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Literal

import httpx
import torch
from pydantic import Field

from titan_rl.sync.transports.base import Engine, Failures, Transport, TransportSection, each_engine
from titan_rl.sync.transports.staging import Staging
from titan_rl.wire.bucket import NamedTensors, bucket_nbytes, dtype_name, flatten_into


class MooncakeSync(TransportSection):
    """``sync.mooncake``: TransferEngine writes into buffers registered by an agent beside
    each engine (``python -m titan_rl.sync.mooncake_agent``)."""

    #: one agent URL per engine, in the engines' order; required with this transport.
    agents: list[str] = Field(default_factory=list)
    #: the TransferEngine's protocol.
    protocol: Literal["tcp", "rdma"] = "tcp"
    #: the RDMA device ("": Mooncake's choice).
    device: str = ""
    #: this trainer's address as the agents reach it.
    host: str = "127.0.0.1"

    def chosen_problem(self) -> str | None:
        if not self.agents:
            return (
                "sync.transport=mooncake needs sync.mooncake.agents: one agent URL per engine "
                "(start `python -m titan_rl.sync.mooncake_agent --engine-url ...` beside each)"
            )
        return None

    def engines_problem(self, num_engines: int, key: str | None = None) -> str | None:
        if len(self.agents) == num_engines:
            return None
        engines = f"{key}={num_engines}" if key else f"{num_engines} engines"
        return (
            f"sync.mooncake.agents has {len(self.agents)} URLs for {engines}; give one agent "
            "per engine, in the engines' order"
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
        self.te = TransferEngine()
        rc = self.te.initialize(mc.host, "P2PHANDSHAKE", mc.protocol, mc.device)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({mc.host!r}, P2PHANDSHAKE, "
                f"{mc.protocol!r}) failed with {rc}; check sync.mooncake.host"
            )
        self.staging = Staging(torch.device("cpu"), shared=False)
        self._registered: tuple[int, int] | None = None
        self.http = httpx.AsyncClient(timeout=timeout_s)

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
                    f"agent's buffer ({n} senders); start the agent with --buffer-bytes >= "
                    f"{n} x sync.bucket_bytes"
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
