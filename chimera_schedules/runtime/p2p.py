"""How the executor moves a tensor to a peer: torch.distributed, or an emulation of NCCL over gloo.

Both offer ``isend``/``irecv`` returning a handle and ``wait(handle)``, which raises RuntimeError when
the peer died or never answered.
"""
from __future__ import annotations

import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist


class TorchP2P:
    """torch.distributed's isend/irecv. ``timeout`` bounds each wait on gloo, where a receive from a
    silent peer would otherwise hang this rank for good. It must be None on NCCL: there a wait with a
    timeout blocks the host until the transfer is done (NCCL_MODEL.md rule 7), while a plain wait only
    makes the compute stream wait; a hung peer is then ended by the process group's timeout and
    NCCL's watchdog, as in Megatron."""

    def __init__(self, timeout: timedelta | None):
        self.timeout = timeout

    def isend(self, tensor: torch.Tensor, rank: int, group):
        return dist.isend(tensor, rank, group=group)

    def irecv(self, tensor: torch.Tensor, rank: int, group):
        return dist.irecv(tensor, rank, group=group)

    def wait(self, work) -> None:
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    @staticmethod
    def done(work) -> bool:
        """Whether the operation has completed, without blocking (a failure is raised by ``wait``). On
        NCCL this queries the operation's CUDA event. torch's gloo p2p work reports completion only
        once waited for, so on gloo sends are held until the flush; the emulated NCCL transport
        (``--emulate-nccl``) reports them as they complete."""
        return work.is_completed()

    def close(self) -> None:
        pass


_DATA, _CLEAR_TO_SEND = 1, 2  # gloo tags


class EmulatedNCCL:
    """NCCL's p2p rules enforced over gloo on the CPU (``--emulate-nccl``): one FIFO stream per
    (group, peer), carrying sends and receives of that pair in posting order (rule 1); a send moves
    only once the peer's stream has reached the matching receive (rule 2), signalled by a small
    clear-to-send message. A schedule that would deadlock on NCCL therefore deadlocks here, and the
    bounded waits turn that into an error instead of a hang. gloo collectives already complete only
    when every member has arrived (rule 4)."""

    def __init__(self, timeout: timedelta):
        self.timeout = timeout
        self.streams: dict[tuple, queue.Queue] = {}

    def isend(self, tensor: torch.Tensor, rank: int, group):
        return self._enqueue("send", tensor, rank, group)

    def irecv(self, tensor: torch.Tensor, rank: int, group):
        return self._enqueue("recv", tensor, rank, group)

    def wait(self, work: _Pending) -> None:
        if not work.done.wait(self.timeout.total_seconds()):
            raise RuntimeError(f"emulated NCCL: timed out after {self.timeout.total_seconds():g}s waiting for "
                               f"the {work.kind} with rank {work.rank} (the peer's stream never reached its partner)")
        if work.error is not None:
            raise RuntimeError(f"emulated NCCL: {work.error}")

    @staticmethod
    def done(work: _Pending) -> bool:
        return work.done.is_set()

    def close(self) -> None:
        """End the stream threads (they hold their process groups)."""
        for ops in self.streams.values():
            ops.put(None)
        self.streams.clear()

    def _enqueue(self, kind: str, tensor: torch.Tensor, rank: int, group) -> _Pending:
        key = (id(group), rank)
        if key not in self.streams:
            self.streams[key] = queue.Queue()
            threading.Thread(target=self._stream, args=(self.streams[key], rank, group), daemon=True).start()
        work = _Pending(kind, tensor, rank)
        self.streams[key].put(work)
        return work

    def _stream(self, ops: queue.Queue, rank: int, group) -> None:
        ticket = torch.zeros(1)
        while (work := ops.get()) is not None:
            try:
                if work.kind == "send":
                    dist.irecv(ticket, rank, group=group, tag=_CLEAR_TO_SEND).wait(self.timeout)
                    dist.isend(work.tensor, rank, group=group, tag=_DATA).wait(self.timeout)
                else:
                    dist.isend(ticket, rank, group=group, tag=_CLEAR_TO_SEND).wait(self.timeout)
                    dist.irecv(work.tensor, rank, group=group, tag=_DATA).wait(self.timeout)
            except RuntimeError as e:
                work.error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            work.done.set()


class _Pending:
    def __init__(self, kind: str, tensor: torch.Tensor, rank: int):
        self.kind, self.tensor, self.rank = kind, tensor, rank
        self.done, self.error = threading.Event(), None
