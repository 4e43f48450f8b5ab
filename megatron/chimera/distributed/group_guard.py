"""After the warm-up, a collective or p2p on a process group it did not walk fails at once.

On NCCL such a call would create the group's communicator (for a single send or receive, the pair's)
then and there: a host-blocking rendezvous while other NCCL kernels may be in flight, which can hang
(NCCL_MODEL.md rule 10), and only on a GPU cluster. The guard turns a group the warm-up missed into a
one-line error naming it, on NCCL and under --emulate-nccl on the CPU alike. Every collective and p2p
entry point of torch.distributed, and megatron-core's aliases of them (``dist_all_gather_func``), ends in
a method of the ProcessGroup: the guard wraps those methods, so nothing that communicates can go around
it. A batch (``batch_isend_irecv``) runs on NCCL on its group's communicator, not a pair's: inside one,
only the group is checked.
"""
from __future__ import annotations

import functools
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
               "_allgather_base", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
               "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "alltoall", "alltoall_base",
               "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier", "monitored_barrier")
P2P = ("send", "recv", "recv_anysource")


class UnwarmedGroup(dist.DistError):
    """A communication call on a group (or pair) that has no communicator yet. A DistError, so the
    trainer reports it as a communication failure, its first line the headline."""


class GroupGuard:
    """Installed over torch's ProcessGroup class for one trainer's life (``install``/``uninstall``)."""

    def __init__(self, warmed):
        self.warmed, self.saved, self.batching = warmed, {}, threading.local()

    def install(self) -> GroupGuard:
        """Wrap each method; its descriptor (pybind11's, which binds the group) is saved to restore. One
        guard at a time: a trainer left unclosed would otherwise refuse the next one's warm-up."""
        cls = dist.ProcessGroup
        if getattr(cls, "_chimera_guarded", False):
            raise RuntimeError("a communicator guard is already installed: close the previous Trainer first")
        cls._chimera_guarded = True
        for name in (*COLLECTIVES, *P2P):
            if name in vars(cls):
                self.saved[name] = vars(cls)[name]
                setattr(cls, name, self._wrap(name, getattr(cls, name)))
        self.saved["batch_isend_irecv"] = c10d.batch_isend_irecv
        dist.batch_isend_irecv = c10d.batch_isend_irecv = self._batch(c10d.batch_isend_irecv)
        return self

    def uninstall(self) -> None:
        batch = self.saved.pop("batch_isend_irecv", None)
        if batch is not None:
            dist.batch_isend_irecv = c10d.batch_isend_irecv = batch
        for name, method in self.saved.items():
            setattr(dist.ProcessGroup, name, method)
        self.saved.clear()
        dist.ProcessGroup._chimera_guarded = False

    def _wrap(self, name: str, method):
        @functools.wraps(method)
        def guarded(group, *args, **kwargs):
            self.check(group, name, args[1] if name in ("send", "recv") else None)
            return method(group, *args, **kwargs)

        return guarded

    def _batch(self, batch_isend_irecv):
        @functools.wraps(batch_isend_irecv)
        def guarded(p2p_op_list):
            self.batching.on = True
            try:
                return batch_isend_irecv(p2p_op_list)
            finally:
                self.batching.on = False

        return guarded

    def check(self, group, op: str, peer: int | None = None) -> None:
        """Raise UnwarmedGroup unless the communicator this call runs on exists: the group's, or for a
        single send or receive (``peer``: the other end's rank in the group) the pair's."""
        if peer is None or getattr(self.batching, "on", False):
            if group not in self.warmed.groups:
                raise UnwarmedGroup(f"{op} on {self.name(group)}: not warmed up before iteration 1, so NCCL would "
                                    f"create its communicator now, while other kernels run (NCCL_MODEL.md rule 10)")
        elif (group, peer) not in self.warmed.pairs:
            raise UnwarmedGroup(f"{op} with rank {peer} on {self.name(group)}: a pair not warmed up before iteration "
                                f"1, so NCCL would create its communicator now, while other kernels run "
                                f"(NCCL_MODEL.md rule 10)")

    def name(self, group) -> str:
        return self.warmed.names.get(group) or f"process group {dist.get_process_group_ranks(group)}"


def guard_communicators(warmed) -> GroupGuard:
    """Install the guard for the groups and pairs ``warmed`` (warmup.WarmedUp) walked."""
    return GroupGuard(warmed).install()
