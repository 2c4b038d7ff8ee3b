"""The GRPO job on a Ray cluster of two "hosts": two Ray nodes started as on two machines
(``ray start --head --node-ip-address 127.0.0.2``, ``ray start --address ... --node-ip-address
127.0.0.3``), each with its own CPUs and a custom resource naming it. ``ray.trainer_resources``
puts the trainer on host A, ``ray.engine_resources`` the engines on host B; the job joins with
``ray.address``. Each weight-sync transport that can cross nodes reaches parity, the engines'
(and the router's) URLs carry host B's address, tensor is refused, and when host B's raylet is
killed the job names the node and its engines, saves its last step and exits 1.

The nodes run with token authentication on (``RAY_AUTH_MODE=token`` and a token of the
test's own, as a user shares ~/.ray/auth_token between machines); every process they started
is killed by pid at the end, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from titan_core.net import free_port
from titan_core.training.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MATH = REPO / "examples/math.yaml"
HOST_A, HOST_B = "127.0.0.2", "127.0.0.3"
RAY = str(Path(sys.executable).with_name("ray"))


@dataclass
class Cluster:
    address: str
    env: dict[str, str]
    started: float

    def node_b_raylet(self) -> psutil.Process:
        for p in _ours(self):
            cmd = " ".join(p.cmdline())
            if "raylet/raylet" in cmd and f"--node_ip_address={HOST_B}" in cmd:
                return p
        raise AssertionError(f"no raylet of {HOST_B} found")


def _ours(cluster: Cluster) -> list[psutil.Process]:
    """The processes of the two nodes (and what they started), by their command lines."""
    marks = (cluster.address, f"={HOST_A}", f"={HOST_B}", f" {HOST_A}", f" {HOST_B}")
    found = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        try:
            if p.info["create_time"] < cluster.started - 1:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if any(m in cmd for m in marks):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _kill_all(cluster: Cluster) -> None:
    procs = {}
    for p in _ours(cluster):
        try:
            for q in [p, *p.children(recursive=True)]:
                procs[q.pid] = q
        except psutil.Error:
            procs[p.pid] = p
    for q in procs.values():
        with contextlib.suppress(psutil.Error):
            q.kill()
    psutil.wait_procs(list(procs.values()), timeout=10)


def _start_node(args: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(
        [RAY, "start", *args, "--disable-usage-stats"], env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _node_b_args(cluster: Cluster) -> list[str]:
    return [
        "--address", cluster.address, "--node-ip-address", HOST_B, "--num-cpus", "2",
        "--resources", '{"host_b": 2}',
    ]  # fmt: skip


#: where ``ray start --head`` records its address, which a plain ``ray.init()`` (address
#: "auto") then joins: restored after the test, so nothing after it meets a dead cluster
CURRENT_CLUSTER = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    env = {k: v for k, v in os.environ.items() if k not in ("TITAN_CONFIG", "RAY_ADDRESS")}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    port = free_port(HOST_A)
    c = Cluster(f"{HOST_A}:{port}", env, time.time())
    before = CURRENT_CLUSTER.read_text() if CURRENT_CLUSTER.is_file() else None
    try:
        _start_node(
            ["--head", "--node-ip-address", HOST_A, "--port", str(port), "--num-cpus", "2",
             "--resources", '{"host_a": 2}', "--include-dashboard", "false"], env,
        )  # fmt: skip
        _start_node(_node_b_args(c), env)
        yield c
    finally:
        _kill_all(c)
        if before is not None:
            CURRENT_CLUSTER.write_text(before)
        else:
            CURRENT_CLUSTER.unlink(missing_ok=True)


def _command(cluster: Cluster, base: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "titan_rl.grpo", "--config", str(MATH), f"policy.load={base}",
        f"run.dir={run_dir}", f"ray.address={cluster.address}", "ray.trainer_resources.host_a=1",
        "ray.engine_resources.host_b=1", "rollout.prompts_per_step=8", "train.micro_batch_size=64",
        "train.ppo_steps=1", "run.eval_interval=null", *overrides,
    ]  # fmt: skip


def _run(cluster: Cluster, cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=cluster.env)  # fmt: skip


@pytest.mark.parametrize("transport", ["distributed", "disk", "mooncake"])
def test_engines_on_host_b_reach_parity(cluster, base, tmp_path, transport):
    """Trainer on A, engine on B: every sync's logprob parity below 1e-4, the engine's and the
    router's URLs on B's address, the rendezvous (distributed) on A's."""
    run_dir = tmp_path / "run"
    extra = {"disk": [f"sync.disk.dir={tmp_path / 'versions'}"]}.get(transport, [])
    cmd = _command(cluster, base, run_dir, "run.num_steps=2", "run.save_interval=null",
                   f"sync.transport={transport}", "sync.check_every=1", "engines.router=true",
                   *extra)  # fmt: skip
    proc = _run(cluster, cmd)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-6000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("engines: "))
    engine_url = re.search(r"engine 0 at (\S+) on node (\S+)", line)
    assert engine_url and engine_url[1].startswith(f"http://{HOST_B}:"), line
    assert engine_url[2] == HOST_B, line
    assert f"listing {engine_url[1]}" in line, line  # the router sends to B's address
    if transport == "mooncake":  # its agent beside it, on B
        assert re.search(rf"mooncake agents at http://{re.escape(HOST_B)}:\d+;", line), line
    placed = next(s for s in proc.stdout.splitlines() if s.startswith("nodes: "))
    assert re.fullmatch(
        rf"nodes: {HOST_A} \(Ray node \w+\): trainer rank 0; {HOST_B} \(Ray node \w+\): engine 0",
        placed,
    ), placed
    recs = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:  # the parity check's measure (sync.max_logprob_diff): the mean
        assert r["sync/logprob_abs_diff_mean"] < 1e-4, r
        print(f"step {r['step']}: logprob |diff| mean {r['sync/logprob_abs_diff_mean']:.2e}, "
              f"max {r['sync/logprob_abs_diff_max']:.2e}")  # fmt: skip
        assert "sync/parity_skipped" not in r or r["sync/parity_skipped"] == 0
        assert "sync/engines_lost" not in r


def test_tensor_to_engines_on_another_host_is_refused(cluster, base, tmp_path):
    cmd = _command(cluster, base, tmp_path / "run", "run.num_steps=1", "sync.transport=tensor")
    proc = _run(cluster, cmd)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sync.transport=tensor" in proc.stderr and f"engine 0 on {HOST_B}" in proc.stderr


#: the losing-host-B run's steps
LOST_HOST_RUN_STEPS = 60


def test_losing_host_b_is_said_saved_and_exits_1_then_the_rerun_resumes(cluster, base, tmp_path):
    """Host B's raylet killed mid-run: the job names the node and the engine it held within
    seconds, saves its last completed step and exits 1 (never hangs); with B back, the same
    command resumes there."""
    run_dir = tmp_path / "run"
    # steps enough that the run cannot end before B's engine goes: a step takes ~0.2 s, and
    # an engine outlives its raylet by a few seconds (the watch says the loss meanwhile)
    cmd = _command(cluster, base, run_dir, f"run.num_steps={LOST_HOST_RUN_STEPS}",
                   "run.save_interval=null", "sync.transport=distributed")  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=cluster.env)  # fmt: skip
    out: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.startswith("step    2"):
                break
        cluster.node_b_raylet().send_signal(signal.SIGKILL)
        killed = time.monotonic()
        said_at = None
        for line in proc.stdout:
            out.append(line)
            if said_at is None and f"lost node {HOST_B}" in line:
                said_at = time.monotonic() - killed
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(out)
    print(f"lost node said {said_at} s after the kill; exit {time.monotonic() - killed:.1f} s")
    assert code == 1, text[-6000:]
    assert said_at is not None, text[-6000:]
    assert re.search(
        rf"lost node {re.escape(HOST_B)} \(Ray node \w+; .*\): engine 0 ran there", text
    )
    last = re.search(r"stopped at step (\d+): engines lost for good \((.*)\); last checkpoint ([^;\s]+);",
                     text)  # fmt: skip
    assert last, text[-6000:]
    assert f"was on node {HOST_B}" in last[2]
    saved = int(last[1])
    assert saved >= 2 and Path(last[3]).name == f"iter_{saved:07d}"
    assert (run_dir / "checkpoints" / f"iter_{saved:07d}").is_dir()
    # host B back: the same command resumes at the saved step
    _start_node(_node_b_args(cluster), cluster.env)
    again = _run(cluster, cmd)
    assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
    assert f"at step {saved}" in again.stdout
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, LOST_HOST_RUN_STEPS + 1)), steps
