"""One ``free_port`` for the trainer's rendezvous, the engines and the weight sync."""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest

from titan_core.net import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", ""])
def test_free_port_can_be_bound_on_its_host(host: str) -> None:
    port = free_port(host)
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, port))
        assert s.getsockname()[1] == port


def test_a_port_in_use_is_not_handed_out() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(20))


def test_free_port_is_defined_once() -> None:
    """The trainer's rendezvous, the engines, the weight sync and the tests share it."""
    repo = Path(__file__).resolve().parents[2]
    found = sorted(
        str(f.relative_to(repo))
        for package in ("titan_core", "titan_rl", "adapters", "bench", "tests")
        for f in (repo / package).rglob("*.py")
        for node in ast.walk(ast.parse(f.read_text(), str(f)))
        if isinstance(node, ast.FunctionDef) and node.name.strip("_") == "free_port"
    )
    assert found == ["titan_core/net.py"]
