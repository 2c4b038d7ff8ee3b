"""The Ray nodes a GRPO job's actors run on, and the watch that says when one is lost.

Ray's GCS declares a node dead only once it has missed its health checks (about 15 s with
Ray's defaults), and until then a call to an actor there fails as "temporarily unavailable".
The watch also asks each node's raylet directly: a TCP connect to its port, which the host
refuses as soon as the raylet is gone. A node is lost when the GCS says it is dead, or when
its raylet refused twice in a row (a raylet the driver cannot reach at all, behind a
firewall, is left to the GCS).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger("titan_rl.nodes")

#: the driver's working folder, given to the actors of a job on a cluster (``ray.address``)
DRIVER_DIR_ENV = "TITAN_DRIVER_DIR"

#: how long a connect to a raylet may take before the try counts as unanswered (not lost)
CONNECT_TIMEOUT_S = 2.0
#: refusals in a row that make a node lost
REFUSALS_TO_LOSE = 2


@dataclass(frozen=True)
class RayNode:
    """One node of the Ray cluster: its id, address and raylet port."""

    node_id: str
    ip: str
    raylet_port: int

    def __str__(self) -> str:
        return f"{self.ip} (Ray node {self.node_id[:8]})"


def ray_nodes(alive_only: bool = False) -> dict[str, RayNode]:
    """The running Ray's nodes by id (``ray.nodes()``: dead ones too, unless ``alive_only``)."""
    import ray

    return {
        n["NodeID"]: RayNode(n["NodeID"], n["NodeManagerAddress"], int(n["NodeManagerPort"]))
        for n in ray.nodes()
        if n.get("Alive") or not alive_only
    }


def raylet_refuses(node: RayNode, timeout_s: float = CONNECT_TIMEOUT_S) -> bool | None:
    """True when the node's host refuses a connection to its raylet's port (the raylet is
    gone), False when it accepts, None when it does not answer in ``timeout_s``."""
    try:
        with socket.create_connection((node.ip, node.raylet_port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return None


class NodeWatch:
    """Which of the job's nodes are lost, and what of the job was on them.

    ``held``: each node and what runs there, in words ("trainer rank 0", "engine 1").
    :meth:`start` checks every ``interval_s`` in a thread and calls ``on_lost`` once per lost
    node (default: one line on stdout), so the loss is said within seconds, whatever the job
    is doing; :meth:`lost` checks now.
    """

    def __init__(
        self,
        held: Mapping[RayNode, list[str]],
        interval_s: float = 1.0,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.held = {node: list(what) for node, what in held.items()}
        self.interval_s = interval_s
        self.on_lost = on_lost or _say
        self._refusals: dict[RayNode, int] = {}
        self._lost: dict[RayNode, str] = {}
        self._said: set[RayNode] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def lost(self) -> dict[RayNode, str]:
        """The lost nodes (checked now) and why each is counted lost."""
        with self._lock:
            pending = [n for n in self.held if n not in self._lost]
            if pending:
                try:
                    alive = set(ray_nodes(alive_only=True))
                except Exception:  # the GCS did not answer: the raylets still can
                    alive = {n.node_id for n in pending}
                for node in pending:
                    if node.node_id not in alive:
                        self._lost[node] = "Ray's GCS reports it dead"
                        continue
                    refused = raylet_refuses(node)
                    count = self._refusals.get(node, 0) + 1 if refused else 0
                    self._refusals[node] = count
                    if count >= REFUSALS_TO_LOSE:
                        self._lost[node] = f"its raylet at {node.ip}:{node.raylet_port} is gone"
            fresh = [n for n in self._lost if n not in self._said]
            self._said.update(fresh)
            found = dict(self._lost)
        for node in fresh:
            self.on_lost(self.describe(node))
        return found

    def known_lost(self) -> dict[RayNode, str]:
        """The nodes found lost so far, without checking now (the watch thread checks)."""
        with self._lock:
            return dict(self._lost)

    def describe(self, node: RayNode) -> str:
        """``node``, why it counts as lost and what of the job was on it, in words."""
        why = self._lost.get(node, "not checked")
        return (
            f"lost node {node.ip} (Ray node {node.node_id[:8]}; {why}): "
            f"{', '.join(self.held[node])} ran there"
        )

    def placed(self) -> str:
        """Where the job's actors run, in one line."""
        return "nodes: " + "; ".join(f"{n}: {', '.join(what)}" for n, what in self.held.items())

    def start(self) -> NodeWatch:
        if self._thread is None and self.held:
            self._thread = threading.Thread(target=self._run, name="titan-node-watch", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.lost()
            except Exception as e:  # a watch that fails must not stop the job
                log.warning("node watch: %s: %s", type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=CONNECT_TIMEOUT_S * 2 + self.interval_s)
            self._thread = None


def _say(line: str) -> None:
    print(line, flush=True)


def enter_driver_dir() -> None:
    """Run from the driver's working folder (:data:`DRIVER_DIR_ENV`) where this node has it,
    so a relative path in the config means what it means on one machine (a worker of a Ray
    cluster starts in its node's session folder); where it is missing, say so once."""
    folder = os.environ.get(DRIVER_DIR_ENV)
    if not folder:
        return
    if os.path.isdir(folder):
        os.chdir(folder)
        return
    print(
        f"the driver's folder {folder} is not on node {socket.gethostname()}: relative paths "
        f"in the config resolve against {os.getcwd()} here; give paths every node sees "
        "(absolute, on a shared file system)",
        flush=True,
    )
