"""The tensor transport's /dev/shm staging outlives no process: after a kill -9 of its owner a
segment is unlinked once nothing maps it, and not while something still does."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not Path("/dev/shm").is_dir() or not sys.platform.startswith("linux"), reason="Linux /dev/shm"
)

#: a process holding one staging buffer of the tensor transport: prints the segment's name
#: and a pickled handle another process can map it with, then waits to be killed
OWNER = """
import base64, io, sys, time, torch
from multiprocessing.reduction import ForkingPickler
from titan_rl.sync.transports.staging import Staging
buf = Staging(torch.device("cpu")).get(1 << 20)
buf.fill_(7)
pickled = io.BytesIO()
ForkingPickler(pickled).dump(buf)
print(buf.untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/"))
print(base64.b64encode(pickled.getvalue()).decode(), flush=True)
time.sleep(600)
"""

#: maps the segment from its pickled handle, reports a byte of it, waits to be killed
MAPPER = """
import base64, pickle, sys, time, torch
buf = pickle.loads(base64.b64decode(sys.argv[1]))
print(int(buf[123]), flush=True)
time.sleep(600)
"""


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], text=True, stdout=subprocess.PIPE, **kw
    )


def _kill_as_ray_does(proc: subprocess.Popen) -> None:
    """kill -9 a process and its children: Ray kills a worker's children when it exits,
    torch's shm manager among them (which would otherwise free the segments)."""
    import psutil

    children = psutil.Process(proc.pid).children()
    assert any(c.name() == "torch_shm_manager" for c in children)
    for p in [psutil.Process(proc.pid), *children]:
        p.kill()
    proc.wait()
    psutil.wait_procs(children, timeout=30)


def _gone(path: Path, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not path.exists()


def test_killed_owners_segment_is_unlinked_after_its_last_mapper(tmp_path):
    owner = _python(OWNER)
    name = owner.stdout.readline().strip()
    handle = owner.stdout.readline().strip()
    segment = Path("/dev/shm") / name
    assert name.startswith("torch_") and segment.exists()
    mapper = _python(MAPPER, handle)
    assert mapper.stdout.readline().strip() == "7"

    _kill_as_ray_does(owner)
    # the reaper leaves it while a process maps it (the engine that read the bucket)
    time.sleep(4)
    assert segment.exists()
    mapper.kill()  # as Ray kills the engine's server
    mapper.wait()
    assert _gone(segment), f"{segment} left in /dev/shm after its owner was killed"


WARM = """
import psutil, torch
from titan_rl.sync.transports.tensor import TensorSync, TensorTransport
me = psutil.Process()
before = {p.name() for p in me.children(recursive=True)}
TensorTransport(TensorSync(), torch.device("cpu"), 10.0).warm()
after = {p.name() for p in me.children(recursive=True)}
print(sorted(after - before))
"""


def test_the_tensor_transport_warms_up_torch_s_shared_memory_manager():
    """``warm`` (run on a thread while the first rollout runs) starts the
    ``torch_shm_manager`` the first shared tensor of a process would otherwise spawn inside
    the first sync."""
    out = subprocess.run(
        [sys.executable, "-c", WARM], capture_output=True, text=True, check=True, timeout=120
    )
    assert "torch_shm_manager" in out.stdout.splitlines()[-1]
