"""A rank's node address (TITAN_NODE_IP, torchrun's --local-addr, the route to the
rendezvous host; never assumed), the names a lost peer is given, and the peer watch between
two nodes' leaders (at 127.0.0.2 and 127.0.0.3: Linux routes all of 127.0.0.0/8 to lo).
The end-to-end runs across two torchrun nodes are in test_two_nodes.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from titan_core.net import NODE_IP_ENV, free_port, node_address, route_source
from titan_core.parallel import nodes
from titan_core.parallel.p2p_channels import P2PPeerLost

REPO = Path(__file__).resolve().parents[2]
A, B = "127.0.0.2", "127.0.0.3"
_LAUNCH_ENV = (NODE_IP_ENV, "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "MASTER_ADDR")


@pytest.fixture
def bare_env(monkeypatch):
    for k in _LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.fixture
def two_nodes():
    nodes._PLACES[:] = [nodes.RankPlace(0, A), nodes.RankPlace(1, B), nodes.RankPlace(1, B)]
    yield
    nodes.clear_nodes()


def test_titan_node_ip_is_this_nodes_address_and_must_be_one_of_its_own(bare_env):
    bare_env.setenv(NODE_IP_ENV, B)
    assert node_address() == B
    bare_env.setenv(NODE_IP_ENV, "203.0.113.9")  # TEST-NET-3: no host has it
    with pytest.raises(ValueError, match=r"TITAN_NODE_IP 203\.0\.113\.9 is not an address of"):
        node_address()


def test_no_address_is_assumed(bare_env):
    # one node, nothing given: each library keeps its own choice
    assert node_address() is None
    # across torchrun nodes: the local end of the route to the rendezvous host
    bare_env.setenv("GROUP_WORLD_SIZE", "2")
    bare_env.setenv("MASTER_ADDR", A)
    assert node_address() == route_source(A) is not None


def test_torchrun_local_addr_is_read_from_the_agents_command_line(tmp_path):
    """torchrun does not hand --local-addr to its workers: a worker reads it back from its
    agent's command line (``torchrun ...`` here is a stand-in that starts one worker)."""
    fake = tmp_path / "torchrun"
    fake.write_text(
        "import subprocess, sys\n"
        "code = 'from titan_core.net import node_address; print(node_address())'\n"
        "sys.exit(subprocess.run([sys.executable, '-c', code]).returncode)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (*_LAUNCH_ENV, "TITAN_CONFIG")}
    env.update(TORCHELASTIC_RUN_ID="t", PYTHONPATH=str(REPO))
    # (the spelling ``--local-addr 127.0.0.3``: test_two_nodes.py's real torchrun)
    out = subprocess.run(
        [sys.executable, str(fake), "--nnodes", "2", f"--local_addr={B}", "-m", "x", "--a", "1"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert out.strip() == B


#: a one-rank gloo job whose groups are bound to B, its store at A: what it listens on
GLOO = """
import sys, psutil, torch.distributed as dist
from titan_core.parallel.nodes import bind_gloo
assert bind_gloo(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.2:{sys.argv[2]}", rank=0, world_size=1)
dist.new_group([0])  # megatron's groups come this way too
print(*{c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"})
dist.destroy_process_group()
"""


def test_gloo_groups_listen_on_the_node_address_only():
    env = {k: v for k, v in os.environ.items() if k not in ("TITAN_CONFIG", "GLOO_SOCKET_IFNAME")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", GLOO, B, str(free_port(A))],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    ).stdout  # fmt: skip
    # the gloo groups on B; the store (rank 0's) on every interface
    assert set(out.split()) - {"::", "0.0.0.0"} == {B}


def test_a_lost_peer_is_named_by_its_node(two_nodes):
    # gloo's two ways of saying it (torch 2.13)
    pair = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537]"
    reset = RuntimeError(f"{pair} Read error [127.0.0.3]:40325: Connection reset by peer. This")
    assert nodes.lost_peer(reset) == "node 1 (127.0.0.3; ranks 1-2): connection reset by peer"
    closed = RuntimeError(f"{pair} Connection closed by peer [127.0.0.1]:47257. This is typic")
    assert nodes.lost_peer(closed) == "the rank at 127.0.0.1: connection closed by peer"
    p2p = P2PPeerLost(
        "Mooncake write of 8 bytes failed (rc -1): credit to pipeline stage 1 (global rank 2)"
    )
    assert nodes.lost_peer(p2p) == (
        "rank 2 (node 1, 127.0.0.3): pipeline P2P over Mooncake: Mooncake write of 8 bytes "
        "failed (rc -1): credit to pipeline stage 1 (global rank 2)"
    )
    assert nodes.lost_peer(RuntimeError("CUDA out of memory")) is None
    assert nodes.describe_rank(0) == "rank 0 (node 0, 127.0.0.2)"


#: a node's leader: its watch, the other leader's port from stdin, then one command
WATCHER = """
import os, sys, time
from titan_core.parallel import nodes, peer_watch
rank = int(sys.argv[1])
addrs = ["127.0.0.2", "127.0.0.3"]
watch = peer_watch.open_watch(addrs[rank])
print(watch.port, flush=True)
ports = [int(p) for p in sys.stdin.readline().split()]
places = [nodes.RankPlace(r, a, p) for r, (a, p) in enumerate(zip(addrs, ports))]
nodes._PLACES[:] = places
peer_watch.set_hint(lambda: "rerun the same command to resume from iter_0000004")
watch.start(rank, places)
print("watching", flush=True)
command = sys.stdin.readline().strip()
if command == "leave":
    peer_watch.leave()
    peer_watch.close_watch()
elif command == "settled":  # the other leader's connection closed, and no alarm came
    while len(watch._sel.get_map()) > 1:
        time.sleep(0.05)
print(command, "done", flush=True)
"""


def _leaders() -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WATCHER, str(rank)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    ports = " ".join(p.stdout.readline().strip() for p in procs)
    for p in procs:
        p.stdin.write(ports + "\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout.readline().strip() == "watching", p.stderr.read()
    return procs


def _finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()


def test_a_leader_that_dies_stops_the_other_naming_its_node():
    procs = _leaders()
    try:
        procs[1].kill()
        assert procs[0].wait(timeout=60) == 1  # its stdin stays open: only the alarm ends it
        err = procs[0].stderr.read()
        assert re.fullmatch(
            r"error: rank 0 \(node 0, 127\.0\.0\.2\): lost node 1 \(127\.0\.0\.3; ranks 1\): its "
            r"connection (closed|was reset)\. The job stops; on every node, rerun the same "
            r"command to resume from iter_0000004",
            err.strip().splitlines()[-1],
        ), err
    finally:
        _finish(procs)


def test_a_leader_that_leaves_on_purpose_stops_nobody():
    procs = _leaders()
    try:
        out, _ = procs[1].communicate("leave\n", timeout=60)
        assert procs[1].returncode == 0 and "leave done" in out
        out, err = procs[0].communicate("settled\n", timeout=60)
        assert procs[0].returncode == 0 and "settled done" in out, err
    finally:
        _finish(procs)
