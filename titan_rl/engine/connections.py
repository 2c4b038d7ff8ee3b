"""Connection limits of the built-in engine's HTTP server: the one place they are enforced.

uvicorn (0.55, h11) has no read timeout for a request in progress: its keep-alive timer runs
only between requests, so a client that opens a connection and never finishes its headers
(or body) holds a file descriptor forever, and ``limit_concurrency`` answers 503 only once a
request is complete. :func:`guarded_protocol` returns uvicorn's h11 protocol with two guards:

- a request deadline: a connection must deliver a whole request (headers and body) within
  ``request_timeout_s`` of its first byte (or of being opened); otherwise it is answered 408
  (when nothing was sent yet) and closed. Time spent producing the response is not limited.
- a connection cap: above ``max_connections`` open connections a new one is answered 503 and
  closed at once, before anything is read, so descriptors cannot run out.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "code": status}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request deadline and a connection cap (class attributes,
    set by :func:`guarded_protocol`)."""

    request_timeout_s: float = 30.0
    max_connections: int = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False

    # ---- connection cap ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            self.transport = transport
            transport.write(
                _raw_response(
                    503,
                    "Service Unavailable",
                    f"the engine holds {len(self.connections)} connections "
                    f"(--max-connections {self.max_connections}); retry later",
                )
            )
            transport.close()
            return
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._refused:
            super().connection_lost(exc)

    # ---- request deadline ----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._request_complete():
            self._disarm()
        else:
            self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # between requests uvicorn's keep-alive timer closes an idle connection; the next
        # request's deadline starts with its first byte (or now, for a pipelined body)
        self._disarm()
        if self.conn.their_state is h11.SEND_BODY:
            self._arm()

    def _request_complete(self) -> bool:
        """Whether no request is being read (the last one arrived whole, or the peer is done)."""
        return self.conn.their_state not in (h11.IDLE, h11.SEND_BODY)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.request_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._request_complete():
            return
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not (
            self.cycle is not None and self.cycle.response_started
        ):
            self.transport.write(
                _raw_response(
                    408,
                    "Request Timeout",
                    f"the request was not received within {self.request_timeout_s:g} s "
                    "(--request-read-timeout)",
                )
            )
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's later sends are dropped
            self.cycle.message_event.set()  # and a pending body read sees the disconnect
        self.transport.close()


def guarded_protocol(request_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` subclass with these limits, for ``uvicorn.run(http=...)``."""
    if request_timeout_s <= 0 or max_connections < 1:
        raise ValueError("request_timeout_s must be > 0 and max_connections >= 1")
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"request_timeout_s": float(request_timeout_s), "max_connections": int(max_connections)},
    )


__all__ = ["GuardedH11Protocol", "guarded_protocol"]
