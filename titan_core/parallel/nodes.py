"""Which node each rank runs on, the address it is reached at, and what a lost node says.

A job across torchrun nodes has each rank bind and advertise its own node's address
(:func:`titan_core.net.node_address`: ``TITAN_NODE_IP``, torchrun's ``--local-addr``, else
the local end of the route to the rendezvous host), never the driver's or loopback by
assumption. Gloo cannot be given an address: it takes the one the host name resolves to
(127.0.1.1 on a stock Ubuntu host, which no other node reaches) or an interface name
(``GLOO_SOCKET_IFNAME``, which picks that interface's first address). torch builds every
gloo group, the default one and megatron's, through ``distributed_c10d.ProcessGroupGloo``
with that default device; :func:`bind_gloo` substitutes a subclass whose device is this
node's address instead. ``GLOO_SOCKET_IFNAME``, when set, is the user's choice and wins.

After start-up every rank knows every rank's node (:func:`gather_nodes`), so a stop or a
lost connection is reported as "rank 1 (node 1, 10.0.0.2)" rather than an address alone;
:mod:`titan_core.parallel.peer_watch` uses the same table to stop the job when a node is gone.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from titan_core.parallel.p2p_channels import P2PPeerLost

#: torch's gloo process group class (None in a build without gloo)
_ORIGINAL_GLOO = getattr(c10d, "ProcessGroupGloo", None)


def bind_gloo(address: str) -> bool:
    """Make every gloo group this process creates from now on bind ``address`` (see the
    module doc). Returns False (nothing changed) when ``GLOO_SOCKET_IFNAME`` is set or torch
    has no gloo."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or _ORIGINAL_GLOO is None:
        return False

    class NodeBoundGloo(_ORIGINAL_GLOO):  # type: ignore[misc, valid-type]
        """ProcessGroupGloo whose default device listens on this node's address."""

        def __init__(
            self,
            store: dist.Store,
            rank: int,
            size: int,
            timeout: timedelta | _ORIGINAL_GLOO._Options = timedelta(minutes=30),
        ) -> None:
            if isinstance(timeout, _ORIGINAL_GLOO._Options):  # options given: used as they are
                super().__init__(store, rank, size, timeout)
                return
            options = _ORIGINAL_GLOO._Options()
            options._timeout = timeout
            options._devices = [_ORIGINAL_GLOO.create_device(hostname=address)]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = NodeBoundGloo
    return True


def unbind_gloo() -> None:
    """Undo :func:`bind_gloo` (groups created since keep their address)."""
    if _ORIGINAL_GLOO is not None:
        c10d.ProcessGroupGloo = _ORIGINAL_GLOO


@dataclass(frozen=True)
class RankPlace:
    #: torchrun's node rank (``GROUP_RANK``)
    node: int
    #: the node's address ("" : not known)
    address: str
    #: the port of the rank's peer-watch listener (0: none, see peer_watch)
    watch_port: int = 0


#: every rank's node and address, filled by :func:`gather_nodes`
_PLACES: list[RankPlace] = []
#: this rank's node address as :func:`gather_nodes` was given it ("" : not known)
_MINE: list[str] = [""]


def gather_nodes(
    address: str | None, watch_port: int = 0, collective: bool = True
) -> list[RankPlace]:
    """Every rank's node (torchrun's ``GROUP_RANK``), address and peer-watch port: a
    collective on the default group, once, right after it starts; without ``collective``
    (one node: nothing to tell apart) only this rank's address is kept."""
    mine = RankPlace(int(os.environ.get("GROUP_RANK", "0")), address or "", watch_port)
    places: list[RankPlace] = [mine] if collective else []
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[RankPlace | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        places = [p for p in gathered if p is not None]
    _PLACES[:] = places
    _MINE[0] = address or ""
    return places


def clear_nodes() -> None:
    _PLACES.clear()
    _MINE[0] = ""
    _REPORTED.clear()


def places() -> list[RankPlace]:
    return list(_PLACES)


def this_node_address() -> str | None:
    """This rank's node address as found at start-up, if one was (see the module doc)."""
    return _MINE[0] or None


def node_count() -> int:
    return len({p.node for p in _PLACES}) or 1


def describe_nodes() -> str:
    """One line: each node, its address and its ranks."""
    by_node: dict[int, list[int]] = {}
    for rank, p in enumerate(_PLACES):
        by_node.setdefault(p.node, []).append(rank)
    return "; ".join(
        f"node {n} at {_PLACES[ranks[0]].address or '?'}: ranks {_ranges(ranks)}"
        for n, ranks in sorted(by_node.items())
    )


def describe_rank(rank: int) -> str:
    """``rank 3`` or, in a job of several nodes, ``rank 3 (node 1, 10.0.0.2)``."""
    if node_count() < 2 or not 0 <= rank < len(_PLACES):
        return f"rank {rank}"
    p = _PLACES[rank]
    return f"rank {rank} (node {p.node}, {p.address or 'address unknown'})"


def describe_address(address: str) -> str | None:
    """The node at ``address`` and its ranks, if it is one of this job's nodes."""
    nodes = {p.node for p in _PLACES if p.address == address}
    return describe_node(nodes.pop()) if len(nodes) == 1 else None


def describe_node(node: int) -> str:
    """``node 1 (10.0.0.2; ranks 8-15)``."""
    ranks = [r for r, p in enumerate(_PLACES) if p.node == node]
    if not ranks:
        return f"node {node}"
    return f"node {node} ({_PLACES[ranks[0]].address or 'address unknown'}; ranks {_ranges(ranks)})"


def _ranges(ranks: list[int]) -> str:
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


#: what gloo says when the process at the other end of a connection is gone ("Read error
#: [10.0.0.2]:40325: Connection reset by peer", "Connection closed by peer [10.0.0.2]:47257")
_GLOO_LOST = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused|"
    r"No route to host|Connection timed out"
)
_GLOO_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
#: how a Mooncake pipeline error names its peer (titan_core.parallel.p2p_mooncake.stage_name)
_STAGE_RANK = re.compile(r"pipeline stage \d+ \(global rank (\d+)\)")


_REPORT_LOCK = threading.Lock()
_REPORTED: list[bool] = []


def claim_report() -> bool:
    """True for the first caller only: a lost peer is reported once per process, by the main
    thread's error or by the peer watch, whichever comes first."""
    with _REPORT_LOCK:
        if _REPORTED:
            return False
        _REPORTED.append(True)
        return True


def lost_message(me: int, lost: str, hint: str) -> str:
    """The one line a rank says when another rank's process or node is gone."""
    return f"error: {describe_rank(me)}: lost {lost}. The job stops; on every node, {hint}"


def lost_peer(error: BaseException) -> str | None:
    """If ``error`` is a lost connection to another rank, who was lost and what was said;
    None for any other error (its traceback then tells the story)."""
    text = str(error)
    m = _GLOO_LOST.search(text) if "gloo" in text else None
    if m is not None:
        peer = _GLOO_PEER.search(text)
        address = peer.group(1) if peer else "an unknown address"
        who = (describe_address(address) if peer else None) or f"the rank at {address}"
        return f"{who}: {m.group(0).lower()}"
    if isinstance(error, P2PPeerLost):
        m = _STAGE_RANK.search(text)
        who = describe_rank(int(m.group(1))) if m else "a pipeline peer"
        first = text.split(";")[0]
        return f"{who}: pipeline P2P over Mooncake: {first}"
    return None
