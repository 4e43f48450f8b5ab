"""The NCCL communicators a lowered schedule makes each worker create.

NCCL creates a communicator for every process group a rank runs a collective on, and, for p2p, one
two-rank communicator per (group, pair of ranks) on its first send or receive between them
(NCCL_MODEL.md rule 10, process groups initialised lazily). Each is a host-blocking rendezvous and
holds its own buffers, so fewer is better, and all of them are created before iteration 1 (the
trainer's warm-up walks ``warm_up_order``). The trainer gives groups with one rank set one process
group: Chimera's stage s and stage D-1-s replica groups and the embedding group are one communicator
(``nccl_model.shared_groups``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.actions import Op
from ..ir.schedule import Schedule


@dataclass(frozen=True)
class Communicators:
    """One worker's p2p ``(group, low worker, high worker)`` pairs; its collective groups are
    ``collective_groups``'."""

    pairs: tuple[tuple[str, int, int], ...]


def communicators(lowered: Schedule) -> list[Communicators]:
    """Per worker, the p2p communicators its lowered list uses."""
    out = []
    for w, actions in enumerate(lowered.workers):
        pairs = {(a.group, min(w, a.peer), max(w, a.peer)) for a in actions if a.op in (Op.SEND, Op.RECV)}
        out.append(Communicators(tuple(sorted(pairs))))
    return out


def collective_groups(lowered: Schedule, worker: int, dp: int, tied: bool = True) -> dict[str, tuple]:
    """The collective groups a rank of ``worker`` reduces on in a dense run, by role, each as the key of
    its rank set (equal keys: one process group, one communicator): the world; the tensor-parallel group
    (megatron-core's vocab-parallel cross entropy all-reduces on it at any size); the replica group of
    each stage it holds with more than one copy (over pipelines and ``dp`` data-parallel replicas); with a
    ``tied`` embedding, the embedding group where it holds the first or last stage. A replica or embedding
    group's ranks are those of the workers holding it (one tensor-parallel rank, every data-parallel one):
    its key is that set of workers. The world keeps its own process group whatever its ranks."""
    holders = lambda stage: frozenset(row[stage] for row in lowered.placement)  # noqa: E731
    held = sorted({stage for _, stage in lowered.held(worker)})
    roles = {"world": ("world",), "tensor-parallel": ("tensor-parallel", worker)}
    roles.update({f"stage {s} replica": ("workers", holders(s)) for s in held if len(holders(s)) * dp > 1})
    last = lowered.stages_per_pipeline - 1
    if tied and last > 0 and {0, last} & set(held):
        roles["embedding"] = ("workers", holders(0) | holders(last))
    return roles


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
