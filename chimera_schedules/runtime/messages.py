"""The messages between stages: where a worker's peers are (Transport), and one iteration's traffic.

A RECV posts a receive into a fresh buffer, waited for only when a compute action needs it. A stage's
output or input gradient is kept until its SEND posts it, or until a stage on this worker takes it (a
local hand-over, as if sent). A send stays in flight, holding its tensor, until it is seen delivered:
completed sends are dropped after every action, the rest at the flush. A failed wait is a PipelineFault
naming the message and the peer.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from ..ir.actions import Action
from ..ir.dataflow import Message
from .faults import PipelineFault, describe_message, first_line, worker_name

type Handle = object  # what a P2P's isend or irecv returns, only ever handed back to its wait and done


class P2P(Protocol):
    """How tensors move to a peer (p2p.py: torch.distributed, or NCCL's rules emulated over gloo)."""

    def isend(self, tensor: torch.Tensor, rank: int, group: dist.ProcessGroup | None) -> Handle: ...

    def irecv(self, tensor: torch.Tensor, rank: int, group: dist.ProcessGroup | None) -> Handle: ...

    def wait(self, work: Handle) -> None:
        """Block until the operation is done; RuntimeError when the peer died or never answered."""

    def done(self, work: Handle) -> bool:
        """Whether the operation has completed, without blocking."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class Transport:
    """Where this worker's peers are. ``ranks[w]`` is the global rank of worker w (same data- and
    tensor-parallel position); ``groups[name]`` the process group a lowered action names (None: the
    default group). ``p2p`` moves the tensors (p2p.py). ``comm_device`` stages p2p through another
    device, e.g. host memory for gloo with CUDA tensors. ``output_rows[s]``: how many activations'
    worth of sequence model stage s sends on (default 1 each): megatron-core's MTP block, on a stage
    of its own, hands the loss stage its depths' hidden states concatenated along the sequence."""

    worker: int
    ranks: Sequence[int]
    groups: dict[str, dist.ProcessGroup | None]
    device: torch.device
    dtype: torch.dtype
    p2p: P2P
    comm_device: torch.device | None = None
    output_rows: Sequence[int] | None = None

    def message_shape(self, shape: tuple, message: Message) -> tuple:
        """A message's shape: an activation is its producer's (the stage before) output, a gradient
        the consumer's own output's."""
        if self.output_rows is None:
            return shape
        kind, _, stage, _ = message
        rows = self.output_rows[stage - 1 if kind == "act" else stage]
        return (shape[0] * rows, *shape[1:])


class PostedReceive(NamedTuple):
    work: Handle
    buffer: torch.Tensor
    action: Action


class Send(NamedTuple):
    """A posted send; ``tensor`` keeps what it sends alive until it is delivered."""

    work: Handle
    tensor: torch.Tensor
    action: Action


class Channel(NamedTuple):
    """Where sends complete in posting order: one stream per group and peer (NCCL_MODEL.md rule 1)."""

    group: str
    peer: int


class Messages:
    """One iteration's messages: posted receives, outputs kept for a send or a local consumer, and
    sends in flight. ``release_sent``: free a sent activation's data (its backward needs only its graph)."""

    def __init__(self, transport: Transport, shape: tuple, release_sent: bool = True):
        self.transport, self.shape, self.release_sent = transport, shape, release_sent
        self.posted: dict[Message, PostedReceive] = {}
        self.kept: dict[Message, torch.Tensor] = {}
        self.sends: dict[Channel, deque[Send]] = {}  # oldest first

    def receive(self, a: Action) -> None:
        t = self.transport
        buffer = torch.empty(t.message_shape(self.shape, a.message), dtype=t.dtype, device=t.comm_device or t.device)
        work = t.p2p.irecv(buffer, t.ranks[a.peer], t.groups[a.group])
        self.posted[a.message] = PostedReceive(work, buffer, a)

    def keep(self, message: Message, tensor: torch.Tensor) -> None:
        self.kept[message] = tensor

    def send(self, a: Action) -> None:
        """Post the send. An activation's own data is then released (Megatron's deallocate_output_tensor):
        the send holds what it needs, and the backward needs only the output's graph."""
        t = self.transport
        kept = self.kept.pop(a.message)
        tensor = kept.detach().to(t.comm_device or t.device, t.dtype).contiguous()
        work = t.p2p.isend(tensor, t.ranks[a.peer], t.groups[a.group])
        self.sends.setdefault(Channel(a.group, a.peer), deque()).append(Send(work, tensor, a))
        if self.release_sent and a.kind == "act" and kept.grad_fn is not None and kept._base is None:
            kept.data = torch.empty((1,), dtype=kept.dtype, device=kept.device)

    def reap(self) -> None:
        """Drop the sends that have completed (a query that does not block), so their tensors are freed
        as soon as they are delivered rather than at the flush. A channel's sends complete in the order
        they were posted, so each channel is queried from its oldest send to the first still in flight:
        a query per channel and per delivered send, however many are in flight (with every send
        queried, an iteration's queries grew as N^2)."""
        for queue in self.sends.values():
            while queue and self.transport.p2p.done(queue[0].work):
                self._delivered(queue.popleft())

    def take(self, message: Message) -> torch.Tensor:
        """The input a compute action needs: its posted receive (waited for now) or a local output."""
        if message not in self.posted:  # from a stage on this worker: a leaf of its own, as if sent
            return self.kept.pop(message).detach()
        work, buffer, a = self.posted.pop(message)
        self._wait(work, a)
        return buffer.to(self.transport.device)

    def claim(self, message: Message, dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
        """An input whose wait comes later: the tensor (of ``dtype``, on the device) it will hold, and the
        wait that fills it. A pair's backward waits only when its parts need the gradient (megatron-core's
        ``pre_backward``), so its forward's first parts need not wait for it. A local output is there."""
        if message not in self.posted:
            return self.kept.pop(message).detach().to(dtype), _nothing
        work, buffer, a = self.posted.pop(message)
        device = self.transport.device
        same = buffer.device == device and buffer.dtype == dtype
        target = buffer if same else torch.empty(buffer.shape, dtype=dtype, device=device)

        def wait() -> None:
            self._wait(work, a)
            if not same:
                target.copy_(buffer)
        return target, wait

    def _wait(self, work, a: Action) -> None:
        try:
            self.transport.p2p.wait(work)
        except RuntimeError as e:  # the peer died or the timeout passed
            raise PipelineFault(f"{worker_name(self.transport.worker)} waited for the "
                                f"{describe_message(a, self.transport.ranks)}: {first_line(e)}", action=a) from None

    def drain(self) -> None:
        for queue in self.sends.values():
            for send in queue:
                self._delivered(send)
        self.sends.clear()

    def held(self) -> dict[str, list[torch.Tensor]]:
        """The tensors held for messages, by why (the Observer protocol's kinds)."""
        return {"receive buffers": [r.buffer for r in self.posted.values()],
                "unsent": list(self.kept.values()),
                "in flight": [send.tensor for queue in self.sends.values() for send in queue]}

    def _delivered(self, send: Send) -> None:
        try:
            self.transport.p2p.wait(send.work)
        except RuntimeError as e:
            raise PipelineFault(f"{worker_name(self.transport.worker)} could not deliver the "
                                f"{describe_message(send.action, self.transport.ranks)}: {first_line(e)}",
                                action=send.action) from None


def _nothing() -> None:
    """The wait of an input that is already there."""
