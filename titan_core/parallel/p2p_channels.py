"""One-directional, ordered message channels between two ranks over Mooncake's TransferEngine.

Each :class:`Endpoint` (one per rank) owns a TransferEngine (TCP transport, P2PHANDSHAKE
metadata: no etcd), a small registered block of control words and one worker thread.

Wire format. A receive ring holds ``slots`` slots of ``capacity`` payload bytes followed by a
64-byte trailer ``[seq, nbytes, kind, ndim, d0..d3]``. A message of ``nbytes`` is written
*ending* at the trailer (payload at ``capacity - nbytes``) in **one** transfer
``[payload | trailer]``: Mooncake's TCP transport writes one transfer sequentially into the
target memory, so the trailer's ``seq`` word lands last and is the receiver's "data has
landed" signal (two separate transfers give no such order: each gets its own connection).

Flow control. The receiver counts what it consumed; the worker writes that count (8 bytes)
into the sender's credit word. The sender writes message ``seq`` only once
``seq - credit <= slots``, so a slot is never overwritten before it has been read.

Growth. Send staging grows locally. A message larger than the peer's ring is announced by a
trailer-only message of kind ``GROW``; the receiver allocates and registers a larger ring and
publishes its address in the process group's TCPStore, where the worker picks it up.

Sends are asynchronous: :meth:`SendChannel.post` copies the tensor into registered staging,
submits the write (``transfer_submit_write``) at once when the peer has room and returns; the
worker thread submits what had to wait for credit, reaps completions and writes the acks. Every wait has a deadline and a failure names the
peer (see ``peer_name``), so a dead or silent peer is an error, never a hang.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: trailer bytes after each slot's payload: int64 words [seq, nbytes, kind, ndim, d0..d3]
TRAILER = 64
_WORDS = TRAILER // 8
_MAX_NDIM = _WORDS - 4
DATA, GROW = 0, 1
#: control words per endpoint: [credit, ack-source] per channel
_CTRL_WORDS = 64


class P2PTransferError(RuntimeError):
    """A pipeline transfer failed or timed out; the message names the peer stage."""


class P2PPeerLost(P2PTransferError):
    """A write to the peer stage failed: its process is gone or its node unreachable."""


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


@dataclass
class RingInfo:
    """What a sender needs to write into a peer's receive ring."""

    session: str
    addr: int
    capacity: int
    slots: int


class Endpoint:
    """One rank's TransferEngine, registered control words and worker thread (the TCP
    transport; the wire format's completion signal relies on its in-order writes)."""

    def __init__(self, host: str, timeout_s: float, protocol: str = "tcp") -> None:
        from mooncake.engine import TransferEngine

        self.timeout_s = timeout_s
        self.te = TransferEngine()
        if self.te.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise P2PTransferError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                "failed; set parallel.p2p_mooncake_host to an address of this node"
            )
        self.session = f"{host}:{self.te.get_rpc_port()}"
        self.ctrl = torch.zeros(_CTRL_WORDS, dtype=torch.int64)
        self._register(self.ctrl)
        self._next_word = 0
        self.senders: list[SendChannel] = []
        self.receivers: list[RecvChannel] = []
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- memory ------------------------------------------------------------------------
    def _register(self, t: torch.Tensor) -> None:
        if self.te.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
            raise P2PTransferError(f"Mooncake could not register {t.numel()} bytes")

    def _unregister(self, t: torch.Tensor) -> None:
        self.te.unregister_memory(t.data_ptr())

    def word(self) -> int:
        """Index of a fresh control word."""
        if self._next_word >= _CTRL_WORDS:
            raise P2PTransferError(f"more than {_CTRL_WORDS // 2} channels on one endpoint")
        self._next_word += 1
        return self._next_word - 1

    def word_addr(self, i: int) -> int:
        return self.ctrl.data_ptr() + 8 * i

    def write(self, session: str, src: int, dst: int, n: int, what: str) -> None:
        rc = self.te.transfer_sync_write(session, src, dst, n)
        if rc != 0:
            raise P2PPeerLost(f"Mooncake write of {n} bytes failed (rc {rc}): {what}")

    # ---- worker ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="titan-p2p-mooncake", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def check(self) -> None:
        """Raise the worker's failure, if any, on the caller's thread."""
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the pass: a wake() during it is not lost
            try:
                busy = False
                for r in self.receivers:
                    busy |= r.flush_ack()
                for s in self.senders:
                    busy |= s.pump()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self.error = e
                return
            if not busy:
                pending = any(s.queue or s.inflight for s in self.senders)
                # credits arrive by remote write (no notification): poll while sends wait
                self._wake.wait(0.0002 if pending else 0.05)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _wait(cond: Callable[[], bool], deadline: float) -> bool:
    """Poll ``cond()`` until it holds (True) or the deadline passes (False).

    Real sleeps, growing from 10 us to 200 us: ``sleep(0)`` would hand the GIL straight
    back to this thread and starve the worker thread that has to move the data.
    """
    pause = 1e-5
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 2e-4)
    return True


class RecvChannel:
    """The receiving end: a registered ring the peer writes into."""

    def __init__(
        self, ep: Endpoint, peer_name: str, slots: int, capacity: int, store: Any, key: str
    ) -> None:
        self.ep, self.peer_name, self.slots = ep, peer_name, slots
        self.store, self.key = store, key
        self.capacity = _align(capacity)
        self.ring = self._new_ring(self.capacity)
        self.expected = 1
        self.consumed = 0
        self.acked = 0
        self.ack_word = ep.word()
        self.peer_session = ""
        self.peer_credit_addr = 0
        self.grows = 0
        self.pending: collections.deque[torch.Tensor] = collections.deque()
        ep.receivers.append(self)

    def _new_ring(self, capacity: int) -> torch.Tensor:
        ring = torch.zeros(self.slots * (capacity + TRAILER), dtype=torch.uint8)
        self.ep._register(ring)
        return ring

    def info(self) -> RingInfo:
        return RingInfo(self.ep.session, self.ring.data_ptr(), self.capacity, self.slots)

    def connect(self, peer_session: str, peer_credit_addr: int) -> None:
        self.peer_session, self.peer_credit_addr = peer_session, peer_credit_addr

    def _trailer(self, slot: int) -> torch.Tensor:
        off = slot * (self.capacity + TRAILER) + self.capacity
        return self.ring[off : off + TRAILER].view(torch.int64)

    def recv(self, make: Callable[[list[int]], torch.Tensor], deadline: float) -> torch.Tensor:
        """Wait for the next message (after any posted with :meth:`post_recv`), copy it into
        ``make(shape it was sent with)`` and free its slot."""
        self.finish(self.expected + len(self.pending) - 1, deadline)
        return self._recv_one(make, deadline)

    def post_recv(self, out: torch.Tensor) -> int:
        """Reserve the next message for ``out`` without waiting; :meth:`finish` fills it."""
        self.pending.append(out)
        return self.expected + len(self.pending) - 1

    def finish(self, ticket: int, deadline: float) -> None:
        """Receive every reserved message up to ``ticket`` into its tensor."""
        while self.expected <= ticket:
            out = self.pending.popleft()
            self._recv_one(lambda _shape, out=out: out, deadline)

    def poll(self) -> None:
        """Fill reserved receives whose messages have landed, without waiting (a sender
        waiting for staging room calls this, so deferred receives cannot deadlock it)."""
        while self.pending:
            tr = self._trailer((self.expected - 1) % self.slots)
            if int(tr[0]) != self.expected:
                return
            if int(tr[2]) == GROW:
                self._grow(int(tr[1]), self.expected)
                continue
            out = self.pending.popleft()
            self._recv_one(lambda _shape, out=out: out, time.monotonic() + self.ep.timeout_s)

    def _recv_one(self, make: Callable[[list[int]], torch.Tensor], deadline: float) -> torch.Tensor:
        seq = self.expected
        slot = (seq - 1) % self.slots
        while True:
            tr = self._trailer(slot)
            if not _wait(lambda tr=tr: int(tr[0]) == seq or self.ep.error is not None, deadline):
                raise P2PTransferError(
                    f"no data from {self.peer_name} within {self.ep.timeout_s:g}s (message "
                    f"{seq}); the peer stage is stuck, dead or out of step "
                    "(raise parallel.p2p_timeout_s if it is only slow)"
                )
            self.ep.check()
            if int(tr[2]) != GROW:
                break
            self._grow(int(tr[1]), seq)
        nbytes, ndim = int(tr[1]), int(tr[3])
        sent_shape = [int(d) for d in tr[4 : 4 + ndim]]
        out = make(sent_shape)
        flat = out.detach().reshape(-1).view(torch.uint8)
        if flat.numel() != nbytes:
            raise P2PTransferError(
                f"{self.peer_name} sent {nbytes} bytes (shape {sent_shape}) where "
                f"{flat.numel()} were expected (shape {list(out.shape)}, {out.dtype}): the "
                "stages disagree on the activation shape or pipeline dtype"
            )
        start = slot * (self.capacity + TRAILER) + self.capacity - nbytes
        with torch.no_grad():
            flat.copy_(self.ring[start : start + nbytes])
        self.expected += 1
        self.consumed = seq
        self.ep.wake()
        return out

    def _grow(self, nbytes: int, seq: int) -> None:
        old = self.ring
        self.capacity = _align(max(nbytes, 2 * self.capacity))
        self.ring = self._new_ring(self.capacity)
        self.grows += 1
        info = {"addr": self.ring.data_ptr(), "capacity": self.capacity}
        self.store.set(f"{self.key}/grow{seq}", json.dumps(info))
        # every earlier message was consumed and the sender writes nothing more to ``old``
        self.ep._unregister(old)

    def flush_ack(self) -> bool:
        """(worker) Tell the sender how many messages were consumed."""
        done = self.consumed
        if done <= self.acked or not self.peer_session:
            return False
        self.ep.ctrl[self.ack_word] = done
        self.ep.write(
            self.peer_session,
            self.ep.word_addr(self.ack_word),
            self.peer_credit_addr,
            8,
            f"credit to {self.peer_name}",
        )
        self.acked = done
        return True


class SendChannel:
    """The sending end: registered staging slots, a queue the worker drains in order."""

    def __init__(
        self, ep: Endpoint, peer_name: str, slots: int, capacity: int, store: Any, key: str
    ) -> None:
        self.ep, self.peer_name, self.slots = ep, peer_name, slots
        self.store, self.key = store, key
        self.credit_word = ep.word()
        self.capacity = _align(capacity)
        self.staging = self._new_staging(self.capacity)
        self.peer: RingInfo | None = None
        self.posted = 0
        #: highest seq the worker has written (its staging slot is free again)
        self.sent = 0
        self.queue: collections.deque[tuple[int, int, float]] = collections.deque()
        #: submitted writes, oldest first: (seq, Mooncake batch id, submitted at)
        self.inflight: collections.deque[tuple[int, int, float]] = collections.deque()
        self._lock = threading.Lock()
        self._grow_key: str | None = None
        self.grows = 0
        ep.senders.append(self)

    @property
    def credit_addr(self) -> int:
        return self.ep.word_addr(self.credit_word)

    def _new_staging(self, capacity: int) -> torch.Tensor:
        buf = torch.zeros(self.slots * (capacity + TRAILER), dtype=torch.uint8)
        self.ep._register(buf)
        return buf

    def connect(self, peer: RingInfo) -> None:
        self.peer = peer

    def post(
        self, tensor: torch.Tensor, deadline: float, progress: Callable[[], None] = lambda: None
    ) -> None:
        """Copy ``tensor`` into a free staging slot and queue it; returns before the transfer.

        The caller may free or modify ``tensor`` right after (megatron deallocates outputs).
        While it waits for a free slot it calls ``progress()`` (the caller's deferred
        receives: the peer may be waiting for this rank to consume before it has room).
        """
        self.ep.check()
        seq = self.posted + 1
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dim() > _MAX_NDIM:
            raise P2PTransferError(f"tensors of more than {_MAX_NDIM} dims cannot be sent")
        grow = nbytes > self.capacity  # grow staging once nothing is in flight

        def free() -> bool:
            progress()
            self.pump()
            done = self.sent == self.posted if grow else seq - self.sent <= self.slots
            return done or self.ep.error is not None

        if not _wait(free, deadline):
            raise P2PTransferError(
                f"sends to {self.peer_name} did not complete within {self.ep.timeout_s:g}s; "
                "the peer stage is stuck or dead"
            )
        self.ep.check()
        if grow:
            old = self.staging
            self.capacity = _align(max(nbytes, 2 * self.capacity))
            self.staging = self._new_staging(self.capacity)
            self.ep._unregister(old)
            self.grows += 1
        slot = (seq - 1) % self.slots
        base = slot * (self.capacity + TRAILER)
        end = base + self.capacity
        src = tensor.detach().contiguous().reshape(-1)
        if nbytes:
            self.staging[end - nbytes : end].copy_(src.view(torch.uint8))
        words = [seq, nbytes, DATA, tensor.dim(), *tensor.shape]
        words += [0] * (_WORDS - len(words))
        self.staging[end : end + TRAILER].view(torch.int64).copy_(torch.tensor(words))
        self.posted = seq
        self.queue.append((seq, nbytes, time.monotonic()))
        self.pump()
        self.ep.wake()

    def pump(self) -> bool:
        """Reap finished writes, then submit queued messages the peer has room for (async
        writes: ``transfer_submit_write``). The worker calls it, and so does :meth:`post`
        right away, whoever gets the lock: no thread hand-off on the common path."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._reap() | self._submit()
        finally:
            self._lock.release()

    def _reap(self) -> bool:
        did = False
        while self.inflight:
            seq, batch, since = self.inflight[0]
            status = self.ep.te.transfer_check_status(batch)
            if status == 0:  # still on the wire
                self._stalled(since, f"take message {seq}")
                return did
            if status != 1:
                raise P2PPeerLost(
                    f"Mooncake write of message {seq} to {self.peer_name} failed (status "
                    f"{status}); the peer stage is unreachable or dead"
                )
            self.inflight.popleft()
            self.sent = seq
            did = True
        return did

    def _submit(self) -> bool:
        assert self.peer is not None, "SendChannel.connect was not called"
        did = False
        while self.queue:
            seq, nbytes, since = self.queue[0]
            if self._grow_key is not None:
                if not self.store.check([self._grow_key]):
                    return self._stalled(since, "grow its receive buffer") or did
                new = json.loads(self.store.get(self._grow_key))
                self.peer.addr, self.peer.capacity = int(new["addr"]), int(new["capacity"])
                self._grow_key = None
            credit = int(self.ep.ctrl[self.credit_word])
            if seq - credit > self.peer.slots:
                return self._stalled(since, "free a slot of its receive buffer") or did
            slot = (seq - 1) % self.slots
            end = slot * (self.capacity + TRAILER) + self.capacity
            pslot = (seq - 1) % self.peer.slots
            pend = pslot * (self.peer.capacity + TRAILER) + self.peer.capacity
            src = self.staging.data_ptr()
            if nbytes > self.peer.capacity:
                if self.inflight:  # every earlier message lands in the old ring first
                    return did
                tr = self.staging[end : end + TRAILER].view(torch.int64)
                tr[2] = GROW
                self.ep.write(
                    self.peer.session, src + end, self.peer.addr + pend, TRAILER,
                    f"to {self.peer_name}",
                )  # fmt: skip
                tr[2] = DATA
                self._grow_key = f"{self.key}/grow{seq}"
                self.grows += 1
                return True
            batch = self.ep.te.transfer_submit_write(
                self.peer.session, src + end - nbytes, self.peer.addr + pend - nbytes,
                nbytes + TRAILER,
            )  # fmt: skip
            if batch < 0:
                raise P2PTransferError(
                    f"Mooncake could not submit message {seq} to {self.peer_name} ({batch})"
                )
            self.queue.popleft()
            self.inflight.append((seq, batch, time.monotonic()))
            did = True
        return did

    def _stalled(self, since: float, waiting_for: str) -> bool:
        if time.monotonic() - since > self.ep.timeout_s:
            raise P2PTransferError(
                f"waited {self.ep.timeout_s:g}s for {self.peer_name} to {waiting_for}; the "
                "peer stage is stuck or dead (raise parallel.p2p_timeout_s if it is only slow)"
            )
        return False

    def drain(self, deadline: float) -> None:
        """Wait until every posted message has been written."""
        if not _wait(lambda: self.sent == self.posted or self.ep.error is not None, deadline):
            raise P2PTransferError(
                f"sends to {self.peer_name} did not complete within {self.ep.timeout_s:g}s"
            )
        self.ep.check()
