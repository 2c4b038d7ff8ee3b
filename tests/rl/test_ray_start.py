"""``init_ray``: a local Ray whose node misses its start-up window is started again, and
the processes the failed start left are killed first (Ray forgets them with the node)."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import ray

from titan_rl.placement import init_ray


def test_a_timed_out_start_is_retried_and_its_processes_killed(monkeypatch):
    left: list[subprocess.Popen] = []
    calls: list[dict] = []

    def fake_init(**kwargs):  # a node start that spawns its processes, then times out
        calls.append(kwargs)
        if len(calls) < 3:
            left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    init_ray(num_cpus=2)
    assert len(calls) == 3 and calls[-1] == {"num_cpus": 2}
    for p in left:  # killed and reaped at once, not after their 60 s
        assert not psutil.pid_exists(p.pid)


def test_other_start_errors_are_raised_at_once(monkeypatch):
    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        raise ValueError("bad argument")

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(ValueError, match="bad argument"):
        init_ray(num_cpus=2)
    assert len(calls) == 1
