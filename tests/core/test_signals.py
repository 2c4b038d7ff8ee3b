"""Stop signals: the first is a request the loop reads, a second stops the job at once with
every descendant; handlers come back after a library replaced them and on exit; a child job
gets the parent's signal and dies with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from titan_core.child_process import stopped_by
from titan_core.signals import StopSignals, active, exit_code


def test_first_signal_is_a_request_and_handlers_come_back():
    seen: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert active() is stop
        stop.on_request(seen.append)
        signal.signal(signal.SIGTERM, lambda *_: None)  # what ray.init does
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM and seen == [signal.SIGTERM]
        assert stop.exit_code == 143 and stop.name == "SIGTERM"
        late: list[int] = []
        stop.on_request(late.append)  # registered after the signal: called at once
        assert late == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before and active() is None
    assert exit_code(signal.SIGINT) == 130
    assert stopped_by(143) == signal.SIGTERM and stopped_by(-signal.SIGINT) == signal.SIGINT
    assert stopped_by(1) is None and stopped_by(0) is None


SECOND_SIGNAL = """
import os, signal, subprocess, sys, time
from titan_core.signals import StopSignals, ignoring
with StopSignals() as stop:
    with ignoring(signal.SIGINT):
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
            "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True); time.sleep(600)"],
            stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    print("requested", stop.requested, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(600)
"""


def test_second_signal_stops_at_once_with_every_descendant():
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SECOND_SIGNAL)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr  # the first signal's
    ignored, pid = proc.stdout.splitlines()[0].split()
    assert ignored == "True"  # started under ignoring(SIGINT): a Ctrl-C leaves it alone
    assert proc.stdout.splitlines()[1] == f"requested {int(signal.SIGINT)}"
    assert "SIGINT received: stopping after the current step" in proc.stderr
    assert "SIGTERM again: stopped at once, the step in progress is lost" in proc.stderr
    assert not _alive(int(pid)), "the descendant outlived the job"


CHILD_JOB = """
import sys
from titan_core.child_process import run_child
from titan_core.signals import StopSignals
with StopSignals():
    code = run_child([sys.executable, "-c", "import signal, sys, time; "
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); print('up', flush=True); "
        "time.sleep(600)"])
print("child exited", code, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_dead(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def _child_of(parent: subprocess.Popen) -> psutil.Process:
    assert parent.stdout.readline().strip() == "up"
    (child,) = psutil.Process(parent.pid).children()
    return child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_child_job_gets_the_stop_signal_and_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", CHILD_JOB], stdout=subprocess.PIPE, text=True)
    child = _child_of(parent)
    assert os.getpgid(child.pid) == child.pid  # its own group: a Ctrl-C reaches it once
    parent.send_signal(signal.SIGTERM)  # forwarded: the child stops as a job stops
    out, _ = parent.communicate(timeout=60)
    assert out.strip() == "child exited 143" and parent.returncode == 0

    parent = subprocess.Popen([sys.executable, "-c", CHILD_JOB], stdout=subprocess.PIPE, text=True)
    child = _child_of(parent)
    parent.kill()  # kill -9: no handler runs in the parent
    parent.wait()
    assert _wait_dead(child.pid), "the child job outlived its killed parent"
