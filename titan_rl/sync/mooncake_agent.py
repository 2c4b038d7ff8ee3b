"""Mooncake receiver beside an engine: registers a shared-memory buffer with a TransferEngine,
and after the trainer has written a bucket into it, hands it to the engine's
``/update_weights_from_tensor`` (flattened bucket, no extra copy on the engine host).

``python -m titan_rl.sync.mooncake_agent --engine-url http://127.0.0.1:30000 --port 30100``
"""

from __future__ import annotations

import argparse
import contextlib
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import torch
import torch.multiprocessing as mp

from titan_rl.wire.bucket import metadata_class
from titan_rl.wire.payload import dumps_bucket


class Agent:
    def __init__(
        self, engine_url: str, host: str, buffer_bytes: int, protocol: str, device: str,
        api_key: str | None = None,
    ) -> None:  # fmt: skip
        from mooncake.engine import TransferEngine

        mp.set_sharing_strategy("file_system")
        self.engine_url = engine_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.buf = torch.empty(buffer_bytes, dtype=torch.uint8).share_memory_()
        self.te = TransferEngine()
        if self.te.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise SystemExit(f"Mooncake TransferEngine.initialize on {host} ({protocol}) failed")
        if self.te.register_memory(self.buf.data_ptr(), buffer_bytes) != 0:
            raise SystemExit("Mooncake could not register the receive buffer")
        self._tp_size: int | None = None
        self.info = {
            "session": f"{host}:{self.te.get_rpc_port()}",
            "addr": self.buf.data_ptr(),
            "size": buffer_bytes,
        }

    def tp_size(self) -> int:
        """The engine's TP size: one payload per engine TP rank (asked once)."""
        if self._tp_size is None:
            r = httpx.get(f"{self.engine_url}/get_server_info", headers=self.headers, timeout=60)
            r.raise_for_status()
            self._tp_size = int(r.json().get("tp_size") or 1)
        return self._tp_size

    def load(self, rows: list[list[Any]]) -> tuple[int, dict[str, Any]]:
        """Hand the bytes the trainer wrote at ``rows`` (absolute offsets: each trainer sender
        writes its own region of the buffer) to the engine."""
        meta_cls = metadata_class()
        meta, end = [], 0
        for name, shape, dtype, start, stop in rows:
            dt = getattr(torch, dtype)
            meta.append(
                meta_cls(name, torch.Size(shape), dt, start, stop, (stop - start) // dt.itemsize)
            )
            end = max(end, stop)
        if end > self.buf.numel():
            return 400, {"success": False, "message": f"metadata ends at {end}, past the buffer"}
        payload = {
            "serialized_named_tensors": [
                dumps_bucket(self.buf[:end], meta) for _ in range(self.tp_size())
            ],
            "load_format": "flattened_bucket",
            "flush_cache": False,
        }
        r = httpx.post(
            f"{self.engine_url}/update_weights_from_tensor", json=payload, headers=self.headers,
            timeout=600,
        )  # fmt: skip
        try:
            data = r.json()
        except ValueError:
            data = {"success": False, "message": r.text[:500]}
        return r.status_code, data


def serve(agent: Agent, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            # a health probe reads the status line and hangs up
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path in ("/info", "/health"):
                self._reply(200, agent.info)
            else:
                self._reply(404, {"message": "unknown path"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/load":
                self._reply(404, {"message": "unknown path"})
                return
            try:
                data = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                status, out = agent.load(data["metadata"])
            except Exception as e:  # a bad request must not kill the agent
                status, out = 400, {"success": False, "message": f"{type(e).__name__}: {e}"}
            self._reply(status, out)

        def log_message(self, *args: Any) -> None:
            return None

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m titan_rl.sync.mooncake_agent")
    p.add_argument("--engine-url", required=True)
    p.add_argument("--host", default="127.0.0.1", help="address for HTTP and Mooncake")
    p.add_argument("--port", type=int, required=True, help="HTTP port of this agent")
    p.add_argument("--buffer-bytes", type=int, default=512 << 20)
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--device", default="", help="RDMA device name(s); empty for tcp")
    p.add_argument("--api-key", default=None, help="the engine's API key")
    a = p.parse_args(argv)
    agent = Agent(a.engine_url, a.host, a.buffer_bytes, a.protocol, a.device, a.api_key)
    server = serve(agent, a.host, a.port)
    print(f"mooncake agent ready on http://{a.host}:{a.port} -> {a.engine_url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
