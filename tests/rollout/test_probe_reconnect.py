"""The engine client's one-attempt probes (``weight_version``, ``health``) against a server
that drops a kept-alive connection as the request arrives, as uvicorn does to one idle past
its keep-alive timeout: a live server is asked again on a fresh connection and answers; one
that only ever drops, or refuses, reads as down."""

from __future__ import annotations

import asyncio
import socket

from titan_rl.rollout import ClientOptions, make_engine_client

BODY = b'{"weight_version": "7"}'
ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)


async def _server(drop: int) -> tuple[asyncio.Server, str, list[int]]:
    """Drops the first ``drop`` requests unanswered, answers the rest; counts requests."""
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readuntil(b"\r\n\r\n"):
            seen[0] += 1
            if seen[0] <= drop:
                writer.close()
                return
            writer.write(ANSWER)
            await writer.drain()

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


def _probe(drop: int) -> tuple[str | None, bool, int]:
    async def main() -> tuple[str | None, bool, int]:
        server, url, seen = await _server(drop)
        client = make_engine_client(url, ClientOptions())
        try:
            return await client.weight_version(), await client.health(), seen[0]
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(main())


def test_a_dropped_connection_is_asked_again_once_and_the_live_server_answers() -> None:
    version, healthy, requests = _probe(drop=1)
    assert version == "7" and healthy
    assert requests == 3  # the dropped one, its retry, the health probe


def test_a_server_that_keeps_dropping_reads_as_down() -> None:
    version, healthy, requests = _probe(drop=10)
    assert version is None and not healthy
    assert requests == 4  # two tries for each probe, no more


def test_a_refused_connection_reads_as_down_without_a_retry() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> str | None:
        client = make_engine_client(f"http://127.0.0.1:{port}", ClientOptions())
        try:
            return await client.weight_version()
        finally:
            await client.aclose()

    assert asyncio.run(main()) is None
