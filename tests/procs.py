"""The processes on this machine by command line (what end-to-end tests look their servers
up by: an engine, a Mooncake agent)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def command_lines() -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of every process whose command line can be read now."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError):
            continue
        yield int(proc.name), args
