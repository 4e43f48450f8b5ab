"""The NCCL communicators a lowered schedule makes each worker create.

NCCL creates a communicator for every process group a rank runs a collective on, and, for p2p, one
two-rank communicator per (group, pair of ranks) on its first send or receive between them
(NCCL_MODEL.md rule 10, process groups initialised lazily). Each is a host-blocking rendezvous and
holds its own buffers, so fewer is better, and all of them are created before iteration 1 (the
trainer's warm-up walks ``warm_up_order``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.actions import Op
from ..ir.schedule import Schedule


@dataclass(frozen=True)
class Communicators:
    """One worker's: p2p ``(group, low worker, high worker)`` pairs and collective groups."""

    pairs: tuple[tuple[str, int, int], ...]
    collectives: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.pairs) + len(self.collectives)


def communicators(lowered: Schedule) -> list[Communicators]:
    """Per worker, the communicators its lowered list uses."""
    out = []
    for w, actions in enumerate(lowered.workers):
        pairs = {(a.group, min(w, a.peer), max(w, a.peer)) for a in actions if a.op in (Op.SEND, Op.RECV)}
        groups = {a.group for a in actions if a.op is Op.ALLREDUCE}
        out.append(Communicators(tuple(sorted(pairs)), tuple(sorted(groups))))
    return out


def warm_up_order(lowered: Schedule) -> list[tuple[str, int, int]]:
    """Every p2p pair of every worker, as (group, sender, receiver) in one global order: each worker
    walks the pairs it is in, in this order, one blocking exchange each. The first unfinished pair of
    the list has both its workers waiting on it, so the walk cannot deadlock."""
    first = {}
    for w, actions in enumerate(lowered.workers):
        for a in actions:
            if a.op is Op.SEND:
                first.setdefault((a.group, min(w, a.peer), max(w, a.peer)), (a.group, w, a.peer))
    return [first[key] for key in sorted(first)]
