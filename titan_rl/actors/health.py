"""An engine that hangs is handled as one that dies.

A server stopped (SIGSTOP), deadlocked or stuck in a system call does not exit, so a
supervisor that only restarts servers that exit never replaces it: the rollout waits on it
with nothing said, and a job whose engine hangs for good waits the whole retry window
(``engines.retry_timeout_s``) before it stops. So the supervisor (``ServerProcess.watch``)
also probes ``GET /health`` every second and keeps a :class:`Silence` per server: how long
it has gone without an answer. After a few seconds of silence it says so (the server, its
URL, how long); once the silence reaches ``health_timeout_s`` it SIGKILLs the server's process
group (SIGKILL also ends a stopped process) and the server is restarted as a dead one is,
and the driver's recovery gives it the current weights before it serves again.

Any HTTP answer counts, a 503 too: the process is running. SGLang's ``/health`` runs a
one-token generation and answers 503 after 20 s when its scheduler is busy (a long weight
update holds it), which must not get an engine killed; no answer at all (a timeout, a refused
or reset connection while the process lives) is what a hung server gives.
"""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlsplit

log = logging.getLogger("titan_rl.actors")

#: at most this long without an answer before the supervisor says so
WARN_AFTER_S = 5.0
#: while the silence lasts, say so again this often
REMIND_EVERY_S = 15.0


def answers(url: str, timeout_s: float) -> bool:
    """Whether the server at ``url`` answers ``GET /health`` (any status) within ``timeout_s``,
    all told: one plain socket, its own deadline (no client to build per probe, nothing
    that could wait past it)."""
    parts = urlsplit(url)
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout_s) as sock:
            sock.sendall(f"GET /health HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n".encode())
            head = b""
            while len(head) < 5:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                sock.settimeout(left)
                chunk = sock.recv(64)
                if not chunk:  # closed without an answer
                    return False
                head += chunk
            return head.startswith(b"HTTP/")
    except OSError:  # refused, reset, timed out
        return False


class Silence:
    """How long one server has gone without answering its health probe, said in the log.

    A silence starts at the server's last answer, so it includes the probe that timed out;
    a server that has not answered since its start is starting (its start-up has its own
    timeout), not silent. ``timeout_s``: the silence after which the server counts as hung
    (``health_timeout_s``). ``longest_s``: the longest silence since the last
    :meth:`take_longest` (one going on included): the step's ``engines/unanswered_s``.
    """

    def __init__(self, name: str, url: str, timeout_s: float) -> None:
        self.name, self.url, self.timeout_s = name, url, timeout_s
        self.warn_after_s = min(WARN_AFTER_S, timeout_s / 2)
        #: seconds one probe may take before it counts as no answer
        self.probe_timeout_s = min(5.0, max(timeout_s / 4, 0.5))
        #: when the last answer came; None: none since the server started
        self.last_answer: float | None = None
        #: the start of the silence going on (the last answer before it), else None
        self.since: float | None = None
        self.longest_s = 0.0
        self._next_warning = 0.0

    def reset(self) -> None:
        """A new server process, starting: nothing answered or unanswered yet."""
        self.last_answer, self.since = None, None

    def answered(self, now: float) -> None:
        if self.since is not None:
            self._note(now)
            if now - self.since >= self.warn_after_s:
                log.warning(
                    "%s: %s answers its health probe again after %.0fs without an answer",
                    self.name, self.url, now - self.since,
                )  # fmt: skip
        self.last_answer, self.since = now, None

    def unanswered(self, now: float, pid: int | None) -> bool:
        """Note a probe without an answer; True once the silence reached ``timeout_s``."""
        if self.last_answer is None:  # still starting
            return False
        if self.since is None:
            self.since = self.last_answer
            self._next_warning = self.since + self.warn_after_s
        silent = now - self.since
        self._note(now)
        if silent >= self.timeout_s:
            log.error(
                "%s: %s (pid %s) has not answered its health probe for %.0fs "
                "(health_timeout_s=%g): killing it (SIGKILL of its process group) to restart it",
                self.name, self.url, pid, silent, self.timeout_s,
            )  # fmt: skip
            return True
        if now >= self._next_warning:
            log.warning(
                "%s: %s (pid %s) has not answered its health probe for %.0fs (hung or stopped?); "
                "it is killed and restarted at %gs (health_timeout_s)",
                self.name, self.url, pid, silent, self.timeout_s,
            )  # fmt: skip
            self._next_warning = now + REMIND_EVERY_S
        return False

    def _note(self, now: float) -> None:
        if self.since is not None:
            self.longest_s = max(self.longest_s, now - self.since)

    def take_longest(self) -> float:
        """The longest silence since the last call (one going on counts from its start)."""
        self._note(time.monotonic())
        out, self.longest_s = self.longest_s, 0.0
        return out
