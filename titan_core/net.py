"""Small network helpers shared by the trainer, the engines and the weight sync."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import socket
import ssl


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now ("" or "0.0.0.0": on every interface).

    The port is released before this returns, so another process may take it first; callers
    that bind it later (a rendezvous, a server) fail loudly rather than share it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def host_address() -> str:
    """This host's address as other hosts reach it: the source address of its route to the
    outside (no packet is sent), else its hostname's address, else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


#: this node's address, as other nodes reach it (an IP or a name); see :func:`node_address`
NODE_IP_ENV = "TITAN_NODE_IP"


def route_source(host: str) -> str | None:
    """The local address this host's route to ``host`` leaves from (no packet is sent): on a
    host with several interfaces, the one that faces ``host``. None if there is no route."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def torchrun_local_addr() -> str | None:
    """The ``--local-addr`` given to the torchrun agent that started this worker, if any.

    torchrun uses it for its own rendezvous but does not pass it on to its workers; it is read
    back from the agent's command line (this process's parent) with torchrun's own parser.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    import psutil

    try:
        argv = psutil.Process(os.getppid()).cmdline()
    except psutil.Error:
        return None
    for i, arg in enumerate(argv):  # python [-flags] (torchrun | -m torch.distributed.run) ...
        if os.path.basename(arg) == "torchrun":
            args = argv[i + 1 :]
            break
        if arg == "-m" and argv[i + 1 : i + 2] == ["torch.distributed.run"]:
            args = argv[i + 2 :]
            break
    else:
        return None
    from torch.distributed.run import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = get_args_parser().parse_args(args)
    except SystemExit:  # not torchrun's command line after all
        return None
    return parsed.local_addr or None


def node_address() -> str | None:
    """This node's address for the job's traffic, when it is known; None: let each library
    choose (gloo takes the address the host name resolves to).

    In order: ``TITAN_NODE_IP``; torchrun's ``--local-addr``; in a job across several torchrun
    nodes, the local end of the route to the rendezvous host (``MASTER_ADDR``). Never the
    driver's host or loopback by assumption: two nodes of one job must each advertise their own.
    """
    given = os.environ.get(NODE_IP_ENV, "").strip()
    if given:
        check_local_address(given, NODE_IP_ENV)
        return given
    local = torchrun_local_addr()
    if local:
        check_local_address(local, "torchrun --local-addr")
        return local
    master = os.environ.get("MASTER_ADDR")
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and master:
        return route_source(master)
    return None


def check_local_address(address: str, source: str) -> None:
    """Raise ValueError unless ``address`` can be bound on this host (it is one of its own)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(sockaddr)
    except OSError as e:
        raise ValueError(
            f"{source} {address} is not an address of this host ({e.strerror or e}); give this "
            f"node's own address (the one the other nodes reach it at)"
        ) from None


@functools.cache
def client_tls() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CAs; ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``
    honoured), made once per process and given to every HTTP client as ``verify=``: httpx
    builds one per client otherwise, 20-35 ms of CPU each, and a job starts several (the
    rollout's, one per engine for the weight sync, the health checks)."""
    import httpx

    return httpx.create_ssl_context()
