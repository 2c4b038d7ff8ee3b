"""megatron-core's pipeline P2P over Mooncake's TransferEngine (``parallel.p2p_transport``).

:class:`MooncakeP2PCommunicator` subclasses megatron-core's ``P2PCommunicator`` and replaces
only ``_communicate``, the one method every ``send_*``/``recv_*`` of the 1F1B and interleaved
(VPP) schedules goes through; it reaches the schedules through their own
``p2p_communicator`` argument (:func:`p2p_schedule_kwargs`), megatron-core is not patched.

Each stage has four channels (``p2p_channels``): activations to the next stage and from the
previous one, gradients to the previous stage and from the next one. Forward and backward
traffic never share a ring, so each channel's messages arrive in the order the schedule
sends them (the k-th ``send_next`` of stage s is the k-th ``recv_prev`` of stage s+1, also
for VPP's wrap-around from the last stage to the first). Ring addresses and sessions are
exchanged once, at construction, with ``all_gather_object`` over the pipeline group.

Sends copy the tensor into registered staging, submit an asynchronous write and return:
Mooncake moves it while the next microbatch computes (the endpoint's worker thread submits
what waits for receive-buffer credit). Receives wait for the trailer's sequence word
(the "data has landed" signal, see ``p2p_channels``) up to ``parallel.p2p_timeout_s``; with
``overlap_p2p_comm`` (VPP) they are deferred to the handle's ``wait()``.
"""

from __future__ import annotations

import atexit
import itertools
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from titan_core.parallel.nodes import this_node_address
from titan_core.parallel.p2p_channels import Endpoint, RecvChannel, SendChannel

#: ring and staging slots per channel: messages a sender may have ahead of its receiver
SLOTS = 4
_INSTANCES = itertools.count()


class _Done:
    """A send handle: the tensor is already in staging, nothing to wait for."""

    def wait(self) -> None:
        return None


class _RecvHandle:
    """A deferred receive (``overlap_p2p_comm``): ``wait()`` fills the tensor."""

    def __init__(self, ch: RecvChannel, ticket: int, timeout_s: float) -> None:
        self.ch, self.ticket, self.timeout_s = ch, ticket, timeout_s

    def wait(self) -> None:
        self.ch.finish(self.ticket, time.monotonic() + self.timeout_s)


def stage_name(stage: int, global_rank: int) -> str:
    return f"pipeline stage {stage} (global rank {global_rank})"


class MooncakeP2PCommunicator(P2PCommunicator):
    """Pipeline P2P through Mooncake-registered rings; see the module docstring."""

    def __init__(
        self,
        pp_group: dist.ProcessGroup,
        config: Any,
        *,
        host: str,
        timeout_s: float,
        capacity_bytes: int,
        device: torch.device,
        slots: int = SLOTS,
    ) -> None:
        super().__init__(pp_group, config)
        self.timeout_s = timeout_s
        self.device = device
        size, me = pp_group.size(), pp_group.rank()
        prev_s, next_s = (me - 1) % size, (me + 1) % size
        prev_name = stage_name(prev_s, self.prev_rank)
        next_name = stage_name(next_s, self.next_rank)
        ranks = "-".join(str(r) for r in dist.get_process_group_ranks(pp_group))
        prefix = f"titan/p2p/{ranks}/{next(_INSTANCES)}"
        store = dist.distributed_c10d._get_default_store()
        self.endpoint = ep = Endpoint(host, timeout_s)
        args = (slots, capacity_bytes, store)
        # a channel's store key is named after its sending stage, so both ends agree
        self.to_next = SendChannel(ep, next_name, *args, f"{prefix}/fwd/{me}")
        self.to_prev = SendChannel(ep, prev_name, *args, f"{prefix}/bwd/{me}")
        self.from_prev = RecvChannel(ep, prev_name, *args, f"{prefix}/fwd/{prev_s}")
        self.from_next = RecvChannel(ep, next_name, *args, f"{prefix}/bwd/{next_s}")
        mine = {
            "session": ep.session,
            "fwd_ring": self.from_prev.info(),
            "bwd_ring": self.from_next.info(),
            "fwd_credit": self.to_next.credit_addr,
            "bwd_credit": self.to_prev.credit_addr,
        }
        peers: list[Any] = [None] * size
        dist.all_gather_object(peers, mine, group=pp_group)
        nxt, prv = peers[next_s], peers[prev_s]
        self.to_next.connect(nxt["fwd_ring"])
        self.to_prev.connect(prv["bwd_ring"])
        self.from_prev.connect(prv["session"], prv["fwd_credit"])
        self.from_next.connect(nxt["session"], nxt["bwd_credit"])
        ep.start()
        atexit.register(self.close)

    def __repr__(self) -> str:
        return f"TransferEngine TCP at {self.endpoint.session}, timeout {self.timeout_s:g}s"

    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Any,
        wait_on_reqs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        deadline = time.monotonic() + self.timeout_s
        reqs: dict[str, Any] = {}
        if tensor_send_next is not None:
            self.to_next.post(tensor_send_next, deadline, self._poll)
            reqs["send_next"] = _Done()
        if tensor_send_prev is not None:
            self.to_prev.post(tensor_send_prev, deadline, self._poll)
            reqs["send_prev"] = _Done()
        got_prev = got_next = None
        if recv_prev:
            got_prev = self._recv(self.from_prev, tensor_shape, wait_on_reqs, reqs, "recv_prev")
        if recv_next:
            got_next = self._recv(self.from_next, tensor_shape, wait_on_reqs, reqs, "recv_next")
        return got_prev, got_next, (None if wait_on_reqs else reqs)

    def _poll(self) -> None:
        self.from_prev.poll()
        self.from_next.poll()

    def _recv(
        self, ch: RecvChannel, shape: Any, wait: bool, reqs: dict[str, Any], key: str
    ) -> torch.Tensor:
        variable = bool(self.config.variable_seq_lengths or self.config.mtp_standalone)
        if shape is None and not variable:
            raise RuntimeError("tensor_shape must be given to receive a pipeline tensor")
        if self.config.pipeline_dtype is None:
            raise RuntimeError("pipeline_dtype must be set to receive a pipeline tensor")

        def make(sent: list[int]) -> torch.Tensor:
            return torch.empty(
                sent if variable else tuple(shape),
                requires_grad=True,
                device=self.device,
                dtype=self.config.pipeline_dtype,
            )

        if wait or variable:
            return ch.recv(make, time.monotonic() + self.timeout_s)
        out = make([])
        reqs[key] = _RecvHandle(ch, ch.post_recv(out), self.timeout_s)
        return out

    def close(self) -> None:
        """Let queued sends finish (bounded by the timeout), then stop the worker."""
        ep = getattr(self, "endpoint", None)
        if ep is None:
            return
        try:
            deadline = time.monotonic() + min(self.timeout_s, 10.0)
            for ch in (self.to_next, self.to_prev):
                ch.drain(deadline)
        except Exception:  # noqa: BLE001, S110 - closing: the peer's receive reports it
            pass
        ep.close()
        self.endpoint = None


def message_bytes(cfg: Any, dtype: torch.dtype) -> int:
    """Bytes of one pipeline activation: (seq / CP [/ TP with SP]) x micro batch x hidden."""
    p = cfg.parallel
    seq = cfg.model.seq_length // p.context_parallel_size
    if p.sequence_parallel:
        seq //= p.tensor_model_parallel_size
    itemsize = torch.empty((), dtype=dtype).element_size()
    return seq * cfg.train.micro_batch_size * cfg.model.hidden_size * itemsize


def default_host() -> str:
    """This node's address for Mooncake's TCP listener: the one found at start-up
    (``TITAN_NODE_IP``, torchrun's ``--local-addr``, the route to the rendezvous host: see
    ``titan_core.parallel.nodes``), else the host name's, else loopback."""
    import socket

    found = this_node_address()
    if found:
        return found
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def p2p_schedule_kwargs(cfg: Any, model_config: Any, device: torch.device) -> dict[str, Any]:
    """Extra arguments for ``get_forward_backward_func()(...)``: none for the torch transport
    (or PP=1), else the Mooncake communicator and the process groups megatron-core then
    needs alongside it (the same ones it builds by default)."""
    p = cfg.parallel
    if p.p2p_transport != "mooncake" or p.pipeline_model_parallel_size == 1:
        return {}
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp = ps.get_tensor_model_parallel_group()
    pgc.cp = ps.get_context_parallel_group()
    pgc.embd = ps.get_embedding_group(check_initialized=False)
    pgc.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    pgc.pp = ps.get_pipeline_model_parallel_group()
    pgc.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    dtype = model_config.pipeline_dtype or torch.float32
    comm = MooncakeP2PCommunicator(
        pgc.pp,
        model_config,
        host=p.p2p_mooncake_host or default_host(),
        timeout_s=p.p2p_timeout_s,
        capacity_bytes=message_bytes(cfg, dtype),
        device=device,
    )
    return {"p2p_communicator": comm, "pg_collection": pgc}
