"""An engine server that hangs (SIGSTOP: it neither answers nor exits) is handled by its
supervisor (``ServerProcess.watch``) as one that dies, once it has not answered its health
probe for ``health_timeout_s``: killed (SIGKILL of its group) and restarted. A shorter
silence is said in the log, naming the server, its URL and how long, and waited out.
The driver's side of it, in the real GRPO job: tests/rl/test_engine_hang_e2e.py."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from titan_rl.actors.config import EngineServerConfig
from titan_rl.actors.health import Silence
from titan_rl.actors.server import ServerProcess


def test_silence_is_said_from_a_few_seconds_and_hung_at_the_timeout(caplog):
    caplog.set_level(logging.WARNING, "titan_rl.actors")
    s = Silence("engine0", "http://127.0.0.1:1", timeout_s=60)
    assert not s.unanswered(100.0, pid=7)  # no answer since its start: starting, not silent
    assert caplog.records == [] and s.take_longest() == 0.0
    s.answered(100.0)
    assert not s.unanswered(102.0, pid=7) and caplog.records == []  # 2 s: not said yet
    assert not s.unanswered(105.0, pid=7)
    assert caplog.messages == [
        "engine0: http://127.0.0.1:1 (pid 7) has not answered its health probe for 5s (hung "
        "or stopped?); it is killed and restarted at 60s (health_timeout_s)"
    ]
    assert not s.unanswered(110.0, pid=7) and len(caplog.records) == 1  # said again at 20 s
    assert not s.unanswered(120.0, pid=7) and "for 20s" in caplog.messages[-1]
    s.answered(130.0)
    assert caplog.messages[-1] == (
        "engine0: http://127.0.0.1:1 answers its health probe again after 30s without an answer"
    )
    assert s.take_longest() == 30.0 and s.take_longest() == 0.0  # per step
    assert not s.unanswered(185.0, pid=7)
    assert s.unanswered(190.0, pid=7)  # 60 s since its last answer: hung
    assert "(health_timeout_s=60): killing it" in caplog.messages[-1]
    assert caplog.records[-1].levelno == logging.ERROR


def test_a_short_timeout_says_so_sooner():
    s = Silence("e", "u", timeout_s=4)
    assert s.warn_after_s == 2 and s.probe_timeout_s == 1


@pytest.mark.slow
def test_a_stopped_server_is_waited_for_then_killed_and_restarted(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "titan_rl.actors")
    cfg = EngineServerConfig(
        model_path=str(tiny_model), backend="builtin", num_threads=1, log_dir=str(tmp_path),
        startup_timeout_s=120, health_timeout_s=8, max_restarts=1,
    )  # fmt: skip
    server = ServerProcess(cfg, name="engine0")
    try:
        server.start()
        server.watch(interval_s=0.2)
        first = server.pid
        assert first is not None
        # stopped for less than the timeout: said (after 4 s), waited out, not restarted
        os.kill(first, signal.SIGSTOP)
        time.sleep(5.5)
        os.kill(first, signal.SIGCONT)
        _until(lambda: any("again after" in m for m in caplog.messages), 10, server)
        assert f"engine0: {server.url} (pid {first}) has not answered its health probe for" in (
            "\n".join(caplog.messages)
        )
        assert server.restarts == 0 and server.pid == first
        assert 4.0 <= server.silence.take_longest() < 8.0
        # stopped for good: killed at the timeout, restarted on the same URL
        t0 = time.monotonic()
        os.kill(first, signal.SIGSTOP)
        _until(lambda: server.restarts == 1 and server.alive() and server.pid != first, 90, server)
        assert server.hung_restarts == 1 and not psutil.pid_exists(first)
        assert time.monotonic() - t0 >= 7.0  # the silence counts from its last answer, before
        assert any("killing it (SIGKILL of its process group)" in m for m in caplog.messages)
        server.wait_healthy(60)
        out = httpx.post(
            server.url + "/generate",
            json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
            timeout=30,
        )
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 2
    finally:
        server.stop()
    assert not server.alive()


def _until(done, timeout_s: float, server: ServerProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
