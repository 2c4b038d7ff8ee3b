"""A caller that sees a supervisor's restart count grow (the GRPO driver's and the adapters'
``engines/restarts``, an owner waiting for its engine back) and then waits for health sees the
restarted process, never the moment between the old one's end and the new one's start."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from titan_rl.actors.config import EngineServerConfig
from titan_rl.actors.server import ServerProcess

#: a server that answers ``GET /health`` (the port is its one argument)
HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class SlowToRelaunch(ServerProcess):
    """Its relaunch takes a while to begin (as a big command line, or a slow fork, can): the
    moment a restart count seen early would leave a caller with no process."""

    launches = 0

    def command(self) -> list[str]:
        self.launches += 1
        if self.launches > 1:
            time.sleep(0.5)
        return [sys.executable, "-c", HEALTH_SERVER, str(self.port)]


def test_a_restart_is_counted_once_its_process_exists(tmp_path: Path) -> None:
    cfg = EngineServerConfig(model_path=str(tmp_path), log_dir=str(tmp_path), max_restarts=1)
    server = SlowToRelaunch(cfg, name="fake")
    server.start(wait=True)
    first = server.pid
    seen: dict[str, object] = {}

    def owner() -> None:  # what the job's owner of an engine does after a kill
        while server.restarts < 1:
            time.sleep(0.001)
        seen["pid"] = server.pid
        try:
            server.wait_healthy(30)
            seen["healthy"] = True
        except RuntimeError as e:
            seen["error"] = str(e)

    watcher = threading.Thread(target=owner)
    watcher.start()
    server.watch(interval_s=0.05)
    try:
        assert first is not None
        os.kill(first, signal.SIGKILL)
        watcher.join(30)
        assert seen.get("healthy") is True, seen
        assert seen["pid"] not in (None, first), seen
    finally:
        server.stop()
