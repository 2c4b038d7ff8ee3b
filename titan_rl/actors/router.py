"""sglang-router (``python -m sglang_router.launch_router``) in front of the engines.

Engines are registered at run time with ``POST /workers`` (sglang-router 0.3.x; the older
``/add_worker`` is gone) and removed with ``DELETE /workers/{id}``.
"""

from __future__ import annotations

import logging
import sys
import time

import httpx

from titan_core.net import client_tls, free_port
from titan_rl.actors.config import EngineLaunch, RouterConfig
from titan_rl.actors.server import HEALTH_POLL_S, ServerProcess

log = logging.getLogger("titan_rl.actors")


def build_router_command(cfg: RouterConfig, port: int, api_key: str | None = None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--policy",
        cfg.policy,
        "--health-check-interval-secs",
        str(cfg.health_check_interval_secs),
        "--health-failure-threshold",
        str(cfg.health_failure_threshold),
        "--retry-max-retries",
        str(cfg.retry_max_retries),
        "--request-timeout-secs",
        str(cfg.request_timeout_secs),
        "--log-level",
        "warn",
    ]
    if "--prometheus-port" not in cfg.extra_args:
        # its metrics exporter binds a fixed port (29000) by default, so a second router on
        # the machine (another job, a test beside a run) panicked with "Address already in use"
        cmd += ["--prometheus-host", cfg.host, "--prometheus-port", str(free_port(cfg.host))]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(cfg.extra_args)


class RouterProcess(ServerProcess):
    """The router process; reuses ServerProcess's start / health / stop (and so dies with
    the driver that starts it: a ``kill -9`` of the driver leaves it not serving on)."""

    def __init__(self, cfg: RouterConfig, api_key: str | None = None, name: str = "router") -> None:
        self.router_cfg = cfg
        self.api_key = api_key
        # ServerProcess's bookkeeping fields (host, port, timeouts, logs); command() is ours
        shim = EngineLaunch(
            model_path="-",
            backend="builtin",
            device="cpu",
            host=cfg.host,
            port=cfg.port,
            startup_timeout_s=cfg.startup_timeout_s,
            restart_on_failure=False,
            log_dir=cfg.log_dir,
        )
        super().__init__(shim, name=name)

    def command(self) -> list[str]:
        return build_router_command(self.router_cfg, self.port, self.api_key)

    def _client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, verify=client_tls())

    def workers(self) -> list[dict]:
        """The router's ``GET /workers`` list."""
        with self._client() as c:
            resp = c.get("/workers")
            resp.raise_for_status()
            return list(resp.json().get("workers", []))

    def add_worker(self, url: str, timeout_s: float = 60.0) -> str:
        """Register an engine and wait until the router lists it as healthy; return its id."""
        body: dict = {"url": url}
        if self.api_key:
            body["api_key"] = self.api_key
        with self._client() as c:
            resp = c.post("/workers", json=body)
            if resp.status_code >= 400:
                raise RuntimeError(
                    f"router refused worker {url}: HTTP {resp.status_code} {resp.text}"
                )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for w in self.workers():
                if w.get("url") == url and w.get("is_healthy", True):
                    return str(w.get("id"))
            time.sleep(HEALTH_POLL_S)
        raise TimeoutError(
            f"router did not list worker {url} as healthy within {timeout_s:.0f}s; "
            f"router log {self.log_path}:\n{self.log_tail()}"
        )

    def remove_worker(self, url: str) -> bool:
        """Deregister an engine by URL; False if the router did not know it."""
        for w in self.workers():
            if w.get("url") == url:
                with self._client() as c:
                    resp = c.delete(f"/workers/{w['id']}")
                    return resp.status_code < 400
        return False
