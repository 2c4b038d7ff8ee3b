"""Small network helpers shared by the trainer, the engines and the weight sync."""

from __future__ import annotations

import socket


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
