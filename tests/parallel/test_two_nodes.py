"""Pretraining across two torchrun nodes that Titan must treat as two hosts: node A at
127.0.0.2 and node B at 127.0.0.3 (Linux routes all of 127.0.0.0/8 to lo), each started the
way a user starts it on its own machine (``torchrun --nnodes 2 --rdzv-endpoint A:PORT
--local-addr <its address>``), PP=2 with stage 0 on A and stage 1 on B.

Each rank binds and advertises its own node's address. A SIGKILL of B's torchrun agent (torch
pipeline P2P), or of all of node B's processes (Mooncake P2P), ends the job on both nodes;
the same two commands resume, and every step's loss, before the kill and after the resume,
is the one-node run's bit for bit. (Two runs per test rather than an uninterrupted one
besides: the suite runs on 2 cores.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.core.pretrain_runner import FAST, REPO, TINY, losses, run_pretrain
from titan_core.checkpoint import latest_iteration
from titan_core.net import free_port

pytestmark = pytest.mark.slow

A, B = "127.0.0.2", "127.0.0.3"
STEPS = 20
#: steps of the tiny model take ~0.2 s here: 20 leave the kill tests time to land mid-run;
#: 1000 samples are enough for them and cost less to make than FAST's 20000
COMMON = [
    *FAST, f"train.train_iters={STEPS}", "parallel.pipeline_model_parallel_size=2",
    "checkpoint.save_interval=4", "data.num_samples=1000",
]  # fmt: skip
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
#: a hang check, not a timing: a run takes ~20 s here, alone on the machine
RUN_TIMEOUT_S = 240


class Nodes:
    """Node A's and node B's torchrun, each in its own session, output to files."""

    def __init__(self, tmp: Path, run_dir: Path, extra: list[str], port: int) -> None:
        self.tmp, self.run_dir = tmp, run_dir
        env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        #: every pid seen under either agent: killed by pid at the end, whatever happens
        self.seen: dict[int, psutil.Process] = {}
        for node, addr in enumerate((A, B)):
            cmd = [
                TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{A}:{port}",
                # on one host both agents would claim the rendezvous store: say who hosts it
                "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", addr,
                "-m", "titan_core.pretrain", "--config", TINY, *COMMON, f"run.dir={run_dir}",
                *extra,
            ]  # fmt: skip
            log = tmp / f"{run_dir.name}.node{node}.{len(list(tmp.glob('*.node*')))}.log"
            self.logs.append(log)
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=REPO,
                        start_new_session=True,
                    )  # fmt: skip
                )
        self.note_pids()

    def note_pids(self) -> None:
        for p in self.procs:
            try:
                tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
            except psutil.Error:
                continue
            for q in tree:
                self.seen.setdefault(q.pid, q)

    def workers(self, node: int) -> list[psutil.Process]:
        return psutil.Process(self.procs[node].pid).children()

    def log(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def tails(self) -> str:
        return "".join(f"\n--- node {n}\n{self.log(n)[-4000:]}" for n in (0, 1))

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"torchrun still running after {timeout}s{self.tails()}"
                ) from None
        return [p.returncode for p in self.procs]

    def gone(self, timeout: float) -> float:
        """Seconds until every process ever seen under either agent has exited."""
        start = time.monotonic()
        while self.live():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"processes left after {timeout}s: {self.live()}")
            time.sleep(0.1)
            for p in self.procs:
                p.poll()
        return time.monotonic() - start

    def live(self) -> list[psutil.Process]:
        out = []
        for q in self.seen.values():
            try:
                if q.is_running() and q.status() != psutil.STATUS_ZOMBIE:
                    out.append(q)
            except psutil.Error:
                pass
        return out

    def kill(self) -> None:
        self.note_pids()
        for q in self.seen.values():
            with contextlib.suppress(psutil.Error):
                q.kill()  # psutil checks the pid is still this process before signalling
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


def _step_reached(run_dir: Path, step: int, nodes: Nodes, timeout: float = 180) -> None:
    """Wait until rank 0 has recorded ``step`` (a hang check); the checkpoints are not read
    meanwhile: the run writes and rotates them."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        nodes.note_pids()
        if metrics.exists() and metrics.read_text().count("\n") >= step:
            return
        if any(p.poll() is not None for p in nodes.procs):
            raise AssertionError(f"a node ended before step {step}{nodes.tails()}")
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout}s{nodes.tails()}")


def _listening(proc: psutil.Process) -> set[str]:
    return {c.laddr.ip for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _check_addresses(nodes: Nodes) -> None:
    """Each node's worker listens on its node's address (Mooncake's listeners: on every
    interface, advertising the node's address), never on the other node's or 127.0.0.1."""
    for node, addr in enumerate((A, B)):
        (worker,) = nodes.workers(node)
        ips = _listening(worker)
        assert addr in ips, (node, ips)
        assert ips <= {addr, "0.0.0.0", "::"}, (node, ips)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The same config on one node (torchrun --nproc-per-node 2), uninterrupted."""
    run_dir = tmp_path_factory.mktemp("one_node")
    run_pretrain(TINY, [*COMMON, f"run.dir={run_dir}"], nproc=2, timeout=RUN_TIMEOUT_S)
    got = losses(run_dir)
    assert len(got) == STEPS
    return got


def _run_to_end(tmp: Path, run_dir: Path, extra: list[str], port: int) -> Nodes:
    nodes = Nodes(tmp, run_dir, extra, port)
    try:
        assert nodes.wait() == [0, 0], nodes.tails()
    finally:
        nodes.kill()
    return nodes


def test_agent_kill_stops_both_nodes_and_the_rerun_resumes(tmp_path, reference):
    """SIGKILL of node B's torchrun agent: B's worker sees its launcher gone, every rank
    stops at the same step, saved; both nodes' processes end; the same commands resume."""
    run_dir, port = tmp_path / "run", free_port(A)
    nodes = Nodes(tmp_path, run_dir, [], port)
    try:
        _step_reached(run_dir, 5, nodes)
        assert f"2 nodes: node 0 at {A}: ranks 0; node 1 at {B}: ranks 1" in nodes.log(0)
        _check_addresses(nodes)
        nodes.procs[1].send_signal(signal.SIGKILL)
        seconds = nodes.gone(timeout=90)
        print(f"agent kill to every process gone: {seconds:.1f} s")
        assert nodes.procs[0].returncode != 0
        out = nodes.log(0)
        assert f"SIGTERM came to rank 1 (node 1, {B}): every rank stops" in out, nodes.tails()
        assert "is gone: stopping after the current step" in nodes.log(1)
    finally:
        nodes.kill()
    stopped = latest_iteration(run_dir / "checkpoints")
    assert stopped is not None and stopped < STEPS
    assert f"stopped by SIGTERM at step {stopped}; saved iter_{stopped:07d}" in out
    rerun = _run_to_end(tmp_path, run_dir, [], port)
    assert f"at step {stopped}" in rerun.log(0)
    assert losses(run_dir) == reference


def test_node_loss_stops_the_other_node_and_the_rerun_resumes(tmp_path, reference):
    """Every process of node B killed (its agent, worker and the worker's children), with
    Mooncake P2P: node A says which node was lost and exits 1; the rerun resumes exactly."""
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")
    extra = ["parallel.p2p_transport=mooncake"]
    run_dir, port = tmp_path / "run", free_port(A)
    nodes = Nodes(tmp_path, run_dir, extra, port)
    try:
        _step_reached(run_dir, 5, nodes)
        _check_addresses(nodes)
        # each stage's TransferEngine advertises its own node's address
        assert f"pipeline P2P over Mooncake (TransferEngine TCP at {A}:" in nodes.log(0)
        assert f"listening on {B}:" in nodes.log(1)
        node_b = psutil.Process(nodes.procs[1].pid)
        for q in [node_b, *node_b.children(recursive=True)]:
            q.kill()
        seconds = nodes.gone(timeout=90)
        print(f"node B killed to every process gone: {seconds:.1f} s")
        assert nodes.procs[0].returncode == 1, nodes.tails()
        assert f"lost node 1 ({B}; ranks 1)" in nodes.log(0), nodes.tails()
        assert "[rank0]: Traceback" not in nodes.log(0), nodes.tails()  # one line says it
    finally:
        nodes.kill()
    last = latest_iteration(run_dir / "checkpoints")
    assert last is not None and last < STEPS
    assert f"resume from {run_dir / 'checkpoints' / f'iter_{last:07d}'}" in nodes.log(0)
    rerun = _run_to_end(tmp_path, run_dir, extra, port)
    assert f"at step {last}" in rerun.log(0)
    assert losses(run_dir) == reference
