"""Launch, watch, restart and stop one rollout server process (SGLang or the CPU engine).

The supervisor (:meth:`ServerProcess.watch`) restarts a server that exits, and one that stops
answering its health probe for ``health_timeout_s`` (killed first; titan_rl/actors/health.py).
Every server dies with the process that started it (titan_core/tied_child.py): a ``kill -9``
of a Ray actor holding an engine, or of the driver holding the router, leaves none behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from titan_core.net import client_tls, free_port
from titan_core.tied_child import popen_tied
from titan_rl.actors.config import EngineLaunch, EngineServerConfig
from titan_rl.actors.health import Silence, answers
from titan_rl.engine_settings import settings_argv

log = logging.getLogger("titan_rl.actors")

_REPO_ROOT = str(Path(__file__).resolve().parents[2])

#: seconds between ``/health`` polls while a server starts: its start is on the job's
#: start-up path, and a refused connection to a server not listening yet costs nothing
HEALTH_POLL_S = 0.05
#: the watch's wait between probes while its server has not answered the last one
SILENT_REPROBE_S = 0.1


def build_command(launch: EngineLaunch, port: int) -> list[str]:
    """The server's command line (SGLang's flag names for both backends): the one place a
    launch becomes argv. The built-in engine's settings are written from their one list
    (titan_rl/engine_settings.py), each left out at the engine's own default."""
    common = ["--model-path", launch.model_path, "--host", launch.host, "--port", str(port)]
    if launch.api_key:
        common += ["--api-key", launch.api_key]
    if launch.skip_tokenizer_init:
        common += ["--skip-tokenizer-init"]
    if launch.backend == "builtin":
        cmd = [sys.executable, "-m", "titan_rl.engine", *common]
        return cmd + settings_argv(launch.model_dump()) + list(launch.extra_args)
    cmd = [sys.executable, "-m", "sglang.launch_server", *common]
    cmd += ["--weight-version", launch.weight_version]
    if launch.context_length:
        cmd += ["--context-length", str(launch.context_length)]
    if launch.dtype != "auto":
        cmd += ["--dtype", launch.dtype]
    if launch.chunked_prefill_size is not None:
        cmd += ["--chunked-prefill-size", str(launch.chunked_prefill_size)]
    cmd += ["--tp-size", str(launch.tp_size), "--base-gpu-id", str(launch.base_gpu_id)]
    cmd += ["--device", launch.device]
    if launch.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(launch.mem_fraction_static)]
    if launch.enable_memory_saver:
        cmd += ["--enable-memory-saver"]
    if launch.enable_return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
    return cmd + list(launch.extra_args)


def build_env(cfg: EngineServerConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.update(cfg.env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _REPO_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([_REPO_ROOT, *paths])
    return env


class ServerProcess:
    """One server process: start, wait for health, restart if it dies, stop cleanly.

    The server runs in its own session (process group) so stopping it also stops the
    workers SGLang spawns, and is SIGKILLed when the process that started it dies (from any
    thread: a Ray actor's, the watch thread). The port is fixed at the first start so a
    restarted server keeps the URL the router knows.
    """

    def __init__(self, cfg: EngineServerConfig, name: str = "engine") -> None:
        #: the launch, as given, or resolved here for this machine from a config
        self.cfg = cfg.launch()
        self.name = name
        self.port = cfg.port or free_port(cfg.host)
        self.restarts = 0
        #: of those, restarts of a server killed for not answering its health probe
        self.hung_restarts = 0
        #: the supervisor saw the server die and will not restart it (max_restarts reached)
        self.gave_up = False
        self._proc: subprocess.Popen | None = None
        self._stopping = False
        #: held while a restart replaces the process: a caller that sees ``restarts`` grow, or
        #: waits for health meanwhile, sees the new process, never the gap between the two
        self._relaunch = threading.Lock()
        self._watch: threading.Thread | None = None
        log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="titan-engine-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.silence = Silence(name, self.url, self.cfg.health_timeout_s)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        return build_command(self.cfg, self.port)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, wait: bool = True) -> str:
        """Launch the server (and wait for ``/health`` unless ``wait`` is False); return its URL."""
        if self.alive():
            return self.url
        self._stopping = False
        with open(self.log_path, "ab") as logf:
            self._proc = popen_tied(
                self.command(),
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=build_env(self.cfg),
                start_new_session=True,
            )
        self.silence.reset()
        log.info("%s: started pid %s on %s", self.name, self._proc.pid, self.url)
        if wait:
            self.wait_healthy()
            self.silence.answered(time.monotonic())
        return self.url

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until 200; raise with the log tail if the process exits or time runs out."""
        deadline = time.monotonic() + (timeout_s or self.cfg.startup_timeout_s)
        with httpx.Client(timeout=5.0, verify=client_tls()) as client:
            while True:
                with self._relaunch:
                    proc = self._proc
                if proc is None:
                    raise RuntimeError(
                        f"{self.name}: server stopped before becoming healthy; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name}: server exited with code {proc.returncode} before becoming "
                        f"healthy; log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name}: {self.url} not healthy after {self.cfg.startup_timeout_s:.0f}s; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(HEALTH_POLL_S)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL after ``timeout_s``."""
        self._stopping = True
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def restart(self) -> str:
        """Replace the server (same port) and wait for it to answer. ``restarts`` counts it
        once the new process exists."""
        with self._relaunch:
            self.stop()
            self.start(wait=False)
            self.restarts += 1
        self.wait_healthy()
        self.silence.answered(time.monotonic())
        return self.url

    # ---- supervision ----------------------------------------------------------------------
    def watch(self, interval_s: float = 1.0) -> None:
        """Start a daemon thread that restarts the server when it dies (up to max_restarts)."""
        if self._watch is not None:
            return
        self._watch = threading.Thread(
            target=self._watch_loop, args=(interval_s,), daemon=True, name=f"watch-{self.name}"
        )
        self._watch.start()

    def _watch_loop(self, interval_s: float) -> None:
        while True:
            # a server gone silent is probed again at once: its return (a stop that ended,
            # a long pause) is seen before it can stop again and look like one long silence
            time.sleep(interval_s if self.silence.since is None else SILENT_REPROBE_S)
            if self._stopping:
                continue
            proc = self._proc
            if proc is None:
                continue
            if proc.poll() is None:
                self._check_answers(proc)
                continue
            if not self.cfg.restart_on_failure or self.restarts >= self.cfg.max_restarts:
                log.error("%s: server exited with %s; not restarting", self.name, proc.returncode)
                self.gave_up = True
                self._watch = None
                return
            log.warning("%s: server exited with %s; restarting", self.name, proc.returncode)
            try:
                self.restart()
            except Exception:
                log.exception("%s: restart failed", self.name)

    def _check_answers(self, proc: subprocess.Popen) -> None:
        """Probe the running server; SIGKILL its group once it has not answered for
        ``health_timeout_s`` (the next round restarts it as a dead one)."""
        answered = answers(self.url, self.silence.probe_timeout_s)
        now = time.monotonic()
        if proc is not self._proc or self._stopping:  # stopped or restarted meanwhile
            return
        if answered:
            self.silence.answered(now)
        elif self.silence.unanswered(now, proc.pid):
            self.hung_restarts += 1
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # a stopped process too
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.error("%s: pid %s still there 10s after SIGKILL", self.name, proc.pid)


class AgentProcess(ServerProcess):
    """The Mooncake agent beside an engine (titan_rl/sync/mooncake_agent.py; the engine's
    launch names it: ``mooncake_agent``): on the engine's host and a free port there, its log
    beside the engine's, and like the engine's server supervised (restarted if it dies, on
    the same port), tied to the process that started it and stopped with its group.

    It reaches its engine by URL at each load, so an engine restarted by its supervisor (same
    URL) is loaded through the same agent."""

    def __init__(self, engine: ServerProcess, name: str) -> None:
        spec = engine.cfg.mooncake_agent
        if spec is None:
            raise ValueError(f"{engine.name}'s launch names no Mooncake agent")
        super().__init__(engine.cfg.model_copy(update={"port": None}), name=name)
        self.spec = spec
        self.engine_url = engine.url

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "titan_rl.sync.mooncake_agent", "--engine-url", self.engine_url,
            "--host", self.cfg.host, "--port", str(self.port),
            "--buffer-bytes", str(self.spec.buffer_bytes), "--protocol", self.spec.protocol,
        ]  # fmt: skip
        if self.spec.device:
            cmd += ["--device", self.spec.device]
        if self.cfg.api_key:
            cmd += ["--api-key", self.cfg.api_key]
        return cmd
