"""The pieces of a GRPO job on a Ray cluster that need no cluster: the placement keys
(``ray.trainer_resources`` / ``ray.engine_resources``) and their checks, the bundles they
ask for, the node watch's verdicts, the rendezvous address on a cluster and the recovery's
message for an engine lost with its node. The cluster itself: tests/rl/test_two_hosts.py."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from titan_core.config import ConfigError, load_config
from titan_core.net import free_port
from titan_rl import nodes
from titan_rl.actors.recovery import EngineLostError, EngineRecovery
from titan_rl.config import GRPOConfig
from titan_rl.grpo import resolve_config
from titan_rl.nodes import NodeWatch, RayNode
from titan_rl.placement import _check_role_resources, plan_placement

REPO = Path(__file__).resolve().parents[2]
MATH = REPO / "examples/math.yaml"
CLUSTER = ("ray.address=10.0.0.1:6379",)


def _cfg(*overrides: str) -> GRPOConfig:
    return resolve_config(load_config(GRPOConfig, MATH, list(overrides)))


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["ray.trainer_resources.host_a=1"], "ray.trainer_resources"),  # no cluster
        ([*CLUSTER, "ray.engine_resources.CPU=1"], "ray.engine_resources.CPU"),
        ([*CLUSTER, "ray.trainer_resources.GPU=1"], "ray.trainer_resources.GPU"),
        ([*CLUSTER, "ray.engine_resources.host_b=0"], "ray.engine_resources.host_b"),
        ([*CLUSTER, "ray.engine_resources.host_b=many"], "ray.engine_resources.host_b"),
    ],
)
def test_placement_keys_are_checked_at_load(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(GRPOConfig, MATH, overrides)


def test_each_role_asks_for_its_resources_and_colocation_is_refused():
    cfg = _cfg(*CLUSTER, "ray.trainer_resources.host_a=1", "ray.engine_resources.host_b=0.5",
               "engines.num_engines=2", "engines.router=true")  # fmt: skip
    plan = plan_placement(cfg, "cpu", None, None)
    assert plan.bundles() == [
        {"CPU": 1, "host_a": 1.0}, {"CPU": 1, "host_b": 0.5}, {"CPU": 1, "host_b": 0.5}
    ]  # fmt: skip
    said = "\n".join(plan.describe())
    assert "ray.trainer_resources" in said and "{'host_b': 0.5}" in said
    # no keys: every bundle alike, as before
    assert plan_placement(_cfg(), "cpu", None, None).bundles() == [{"CPU": 1}, {"CPU": 1}]
    colocated = _cfg(*CLUSTER, "ray.engine_resources.host_b=1", "engines.colocate=true")
    with pytest.raises(ConfigError, match=r"ray\.engine_resources.*engines\.colocate"):
        plan_placement(colocated, "cpu", None, None)


def test_a_resource_the_cluster_lacks_is_refused_naming_the_key():
    cfg = _cfg(*CLUSTER, "ray.trainer_resources.host_a=1", "ray.engine_resources.host_b=1",
               "engines.num_engines=2", "engines.router=true")  # fmt: skip
    plan = plan_placement(cfg, "cpu", None, None)
    _check_role_resources(plan, {"CPU": 8, "host_a": 1, "host_b": 2})  # enough
    with pytest.raises(
        ConfigError, match=r"ray\.engine_resources\.host_b: .* needs 2 host_b .* has 1"
    ):
        _check_role_resources(plan, {"CPU": 8, "host_a": 1, "host_b": 1})
    with pytest.raises(ConfigError, match=r"ray\.trainer_resources\.host_a: .* has 0"):
        _check_role_resources(plan, {"CPU": 8, "host_b": 2})


def test_the_distributed_rendezvous_is_each_senders_node_on_a_cluster():
    dist = ("sync.transport=distributed",)
    assert _cfg(*dist).sync.distributed.master_address == "127.0.0.1"  # one machine
    assert _cfg(*CLUSTER, *dist).sync.distributed.master_address == "auto"
    given = _cfg(*CLUSTER, *dist, "sync.distributed.master_address=10.0.0.1")
    assert given.sync.distributed.master_address == "10.0.0.1"  # the user's stands
    again = resolve_config(_cfg(*CLUSTER, *dist))  # idempotent, and a dump validates again
    GRPOConfig.model_validate(again.model_dump(mode="json", by_alias=True))
    # another transport's section keeps its defaults (only the chosen one may be set)
    tensor = _cfg(*CLUSTER)
    GRPOConfig.model_validate(tensor.model_dump(mode="json", by_alias=True))


@pytest.fixture
def listening():
    """A node whose raylet port accepts connections, and one whose port refuses them."""
    server = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    gone_port = closed.getsockname()[1]
    closed.close()
    up = RayNode("a" * 56, "127.0.0.1", server.getsockname()[1])
    gone = RayNode("b" * 56, "127.0.0.1", gone_port)
    yield up, gone
    server.close()


def test_a_node_whose_raylet_refuses_twice_is_lost_and_said_once(listening, monkeypatch):
    up, gone = listening
    monkeypatch.setattr(nodes, "ray_nodes", lambda alive_only=False: {
        n.node_id: n for n in (up, gone)})  # fmt: skip  # Ray's view: both still alive
    said: list[str] = []
    watch = NodeWatch({up: ["trainer rank 0"], gone: ["engine 0", "engine 1"]}, on_lost=said.append)
    assert watch.lost() == {}  # one refusal is not enough
    lost = watch.lost()
    assert list(lost) == [gone] and "raylet" in lost[gone]
    watch.lost()
    assert said == [
        f"lost node 127.0.0.1 (Ray node bbbbbbbb; its raylet at 127.0.0.1:{gone.raylet_port} "
        "is gone): engine 0, engine 1 ran there"
    ]


def test_a_node_ray_reports_dead_is_lost_at_once(listening, monkeypatch):
    up, gone = listening
    monkeypatch.setattr(nodes, "ray_nodes", lambda alive_only=False: {})  # every node dead
    watch = NodeWatch({up: ["engine 0"]}, on_lost=lambda line: None)
    assert watch.lost() == {up: "Ray's GCS reports it dead"}


def test_the_watch_thread_says_a_lost_node_by_itself(listening, monkeypatch):
    up, gone = listening
    monkeypatch.setattr(nodes, "ray_nodes", lambda alive_only=False: {gone.node_id: gone})
    said: list[str] = []
    watch = NodeWatch({gone: ["engine 0"]}, interval_s=0.05, on_lost=said.append).start()
    try:
        for _ in range(200):
            if said:
                break
            asyncio.run(asyncio.sleep(0.05))
    finally:
        watch.stop()
    assert len(said) == 1 and said[0].startswith("lost node 127.0.0.1")


def test_an_engine_lost_with_its_node_stops_the_wait_naming_the_node():
    url = "http://127.0.0.3:1"  # nothing listens: the engine does not answer
    why = "engine 0 (http://127.0.0.3:1) was on node 127.0.0.3 (Ray node 6c400525), lost: ..."
    recovery = EngineRecovery(
        [url], lambda urls, version: {}, timeout_s=60, interval_s=0.01,
        gave_up=lambda: [url], why_lost={url: why}.get,
    )  # fmt: skip
    with pytest.raises(EngineLostError, match=r"was on node 127\.0\.0\.3"):
        asyncio.run(recovery.ensure_serving())


#: a weight-update group (world 1) joined with TITAN_NODE_IP set: what its process listens on
GROUP = """
import sys, psutil
from titan_rl.engine.cli import bind_weight_groups
from titan_rl.wire.group import init_weights_update_group
bind_weight_groups()
init_weights_update_group("127.0.0.2", int(sys.argv[1]), 0, 1, "titan-test", "gloo", 60)
print(*{c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"})
"""


def test_a_weight_update_group_listens_on_the_node_address_only():
    """On a cluster the engines (and the trainer ranks) get their node's address
    (``TITAN_NODE_IP``): the engine's gloo group of the weight sync binds it, not the address
    the host name resolves to (127.0.1.1 on a stock Ubuntu host, which no other node
    reaches). The trainer side binds it in titan_core's initialize (tests/parallel/
    test_nodes.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TITAN_CONFIG", "GLOO_SOCKET_IFNAME")}
    out = subprocess.run(
        [sys.executable, "-c", GROUP, str(free_port("127.0.0.2"))], capture_output=True,
        text=True, env=env | {"TITAN_NODE_IP": "127.0.0.3", "PYTHONPATH": str(REPO)},
        check=True, timeout=120,
    ).stdout  # fmt: skip
    assert set(out.split()) - {"::", "0.0.0.0"} == {"127.0.0.3"}  # the store: every interface
