"""Across torchrun nodes, a node that is gone stops the whole job within seconds.

torchrun's agent supervises its own node's workers only. When another node's processes die,
a worker learns it from its next collective: at once if that node's kernel resets the
connections (its processes were killed), but only after ``parallel.distributed_timeout_minutes``
if the node lost power or its network, or if a forked child of the dead worker (a checkpoint
writer) still holds the connections open.

So the first worker of each node (local rank 0, "the leader") listens on its node's address,
and after start-up every leader holds one TCP connection to every other leader (the lower
rank connects), with TCP keepalive (a host that is gone is noticed in about
``KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT`` seconds). A daemon thread waits
on them. A connection that ends without its peer having said goodbye means that node's
leader is gone. Unless this process ends on its own within ``ALARM_GRACE_S`` (an error every
rank met, which each reports), the thread says which node and ranks were lost, kills this
process's children and exits 1. It cannot do better: a collective in progress cannot be
interrupted, and nothing can be saved without the lost ranks; the last checkpoint stands.
The other workers of the leader's node are stopped by their torchrun agent when it exits.

A rank whose training ended (finished, or stopped and saved) says goodbye first
(:func:`leave`); any other end does not, so it stops the other nodes too rather than leaving
them waiting in a collective for a rank that errored out alone.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import sys
import threading
from collections.abc import Callable

from titan_core.parallel.nodes import RankPlace, claim_report, describe_node, lost_message

#: TCP keepalive on the leaders' connections: idle seconds, then probes every interval, and
#: how many unanswered probes close the connection
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3
#: seconds a leader may take to connect to another node's leader at start-up
CONNECT_TIMEOUT_S = 30.0
#: seconds between a lost connection and the alarm: time for this process to end on its own
ALARM_GRACE_S = 2.0
#: the exit status of a job a lost node stopped
EXIT_LOST_NODE = 1
_BYE = b"\x01"
_HELLO = struct.Struct("!i")


def _keepalive(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class PeerWatch:
    """One leader's listener, its connections to the other leaders and the thread that
    watches them (see the module doc)."""

    def __init__(self, address: str | None) -> None:
        host = address or "0.0.0.0"  # noqa: S104 - no address known: every interface
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(128)
        self.port = int(self.listener.getsockname()[1])
        self.rank = -1
        self.places: list[RankPlace] = []
        #: where a rerun resumes from, in words (said when a node is lost)
        self.hint: Callable[[], str] = lambda: "rerun the same command to resume"
        self._peers: dict[socket.socket, int] = {}
        self._leaving: set[int] = set()
        #: the lost nodes' descriptions and why, in the order their connections ended
        self.lost: list[str] = []
        self._lost_event = threading.Event()
        self._disarmed = False
        self._closed = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._thread: threading.Thread | None = None

    def start(self, rank: int, places: list[RankPlace]) -> None:
        """Connect to the leaders of higher rank (theirs listen already: they were created
        before the ranks exchanged ports) and start watching."""
        self.rank, self.places = rank, places
        leaders = [r for r, p in enumerate(places) if p.watch_port and r != rank]
        for r in (r for r in leaders if r > rank):
            p = places[r]
            try:
                s = socket.create_connection((p.address, p.watch_port), CONNECT_TIMEOUT_S)
            except OSError as e:
                raise RuntimeError(
                    f"rank {rank} cannot reach {describe_node(p.node)} at "
                    f"{p.address}:{p.watch_port} ({e.strerror or e}): the nodes must reach each "
                    "other on every TCP port (a firewall?), at the addresses given by "
                    "TITAN_NODE_IP or torchrun --local-addr"
                ) from None
            _keepalive(s)
            s.sendall(_HELLO.pack(rank))
            self._watch(s, r)
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="titan-peer-watch", daemon=True)
        self._thread.start()

    def _watch(self, s: socket.socket, peer: int) -> None:
        s.setblocking(False)
        self._peers[s] = peer
        self._sel.register(s, selectors.EVENT_READ, peer)

    def leave(self) -> None:
        """This rank ends on purpose: tell the other leaders, and raise no alarm from now on."""
        self._disarmed = True
        for s in list(self._peers):
            with contextlib.suppress(OSError):
                s.setblocking(True)
                s.sendall(_BYE)

    def close(self) -> None:
        self._disarmed = True
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for s in [*self._peers, self.listener]:
            with contextlib.suppress(OSError):
                s.close()
        self._sel.close()

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is None:
                    self._accept()
                    continue
                s, peer = key.fileobj, key.data
                assert isinstance(s, socket.socket)
                why = "its connection closed"
                try:
                    data = s.recv(64)
                except BlockingIOError:
                    continue
                except ConnectionResetError:  # it died with data unread: its kernel resets
                    data, why = b"", "its connection was reset"
                except OSError as e:
                    data, why = b"", f"its connection failed: {e.strerror or e}"
                if data:
                    if _BYE in data:
                        self._leaving.add(peer)
                    continue
                self._sel.unregister(s)
                s.close()
                if peer not in self._leaving and not self._disarmed:
                    self._alarm(peer, why)

    def _accept(self) -> None:
        try:
            s, _ = self.listener.accept()
        except OSError:
            return
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            hello = b""
            while len(hello) < _HELLO.size:
                chunk = s.recv(_HELLO.size - len(hello))
                if not chunk:
                    raise OSError("closed before saying its rank")
                hello += chunk
        except OSError:
            s.close()
            return
        _keepalive(s)
        self._watch(s, _HELLO.unpack(hello)[0])

    def _alarm(self, peer: int, why: str) -> None:
        node = self.places[peer].node if 0 <= peer < len(self.places) else peer
        lost = f"{describe_node(node)}: {why}"
        self.lost.append(lost)
        self._lost_event.set()
        # this process may be ending on its own (an error every rank met), or its main
        # thread reporting this loss from a failed collective: either closes the watch
        if self._closed.wait(ALARM_GRACE_S) or not claim_report():
            return
        _say(lost_message(self.rank, lost, self.hint()))
        from titan_core.signals import kill_descendants

        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        kill_descendants()
        os._exit(EXIT_LOST_NODE)


def _say(text: str) -> None:
    """One line on stderr through its descriptor (the main thread may be inside a print)."""
    with contextlib.suppress(OSError):
        os.write(2, f"{text}\n".encode())


#: this process's watch, if it is a node's leader in a job across nodes
_WATCH: list[PeerWatch] = []


def open_watch(address: str | None) -> PeerWatch:
    """Create this process's listener (before the ranks exchange their ports)."""
    watch = PeerWatch(address)
    _WATCH[:] = [watch]
    return watch


def set_hint(hint: Callable[[], str]) -> None:
    """Where a rerun resumes from, said when a node is lost."""
    for w in _WATCH:
        w.hint = hint


def lost_node(timeout_s: float) -> str | None:
    """The first node the watch saw lost, and why, waiting up to ``timeout_s`` for one (a
    failed collective can come first); None without a watch or a lost node."""
    for w in _WATCH:
        if w._lost_event.wait(timeout_s):
            return w.lost[0]
    return None


def leave() -> None:
    """This rank ends on purpose (see the module doc); nothing without a watch."""
    for w in _WATCH:
        w.leave()


def close_watch() -> None:
    for w in _WATCH:
        w.close()
    _WATCH.clear()
