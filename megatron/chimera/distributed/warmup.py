"""Every NCCL communicator this rank needs, created before iteration 1.

NCCL creates a communicator on a group's first collective, and a two-rank one on a (group, pair)'s
first send or receive: a host-blocking rendezvous. Left to iteration 1 it would happen while other
NCCL kernels are in flight, which NCCL's documentation warns can hang (NCCL_MODEL.md rule 10). So
every rank walks one global order before training: its collective groups (the world, its tensor-
parallel group, with expert parallelism the dispatcher's expert group, the replica groups of the
stages it holds in stage order, then their expert replica groups, the tied-embedding group),
then every p2p pair the lowered lists use (``warm_up_order``), one blocking exchange each. Both walks
follow one order on every rank, so the first unfinished step always has all its members waiting on
it: the walk cannot deadlock. On gloo it costs a few milliseconds and changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chimera_schedules.analysis.communicators import warm_up_order


@dataclass(frozen=True)
class WarmedUp:
    collectives: int
    pairs: int


def warm_up_communicators(rt, transport, lowered, tied: bool) -> WarmedUp:
    """Collective: every rank calls it. ``transport`` and ``lowered`` are None under megatron-core's
    own schedules, whose p2p communicators megatron-core creates itself."""
    collectives = _collective_groups(rt, tied)
    one = torch.zeros(1, device=rt.device)
    for group in collectives:
        rt.all_reduce(one, group=group)
    pairs = 0
    if lowered is not None:
        buffer = torch.zeros(1, dtype=transport.dtype, device=transport.comm_device or transport.device)
        for group, src, dst in warm_up_order(lowered):
            if rt.worker in (src, dst):
                post = transport.p2p.isend if rt.worker == src else transport.p2p.irecv
                transport.p2p.wait(post(buffer, transport.ranks[dst if rt.worker == src else src],
                                        transport.groups[group]))
                pairs += 1
    return WarmedUp(len(collectives), pairs)


def _collective_groups(rt, tied: bool) -> list:
    """The groups this rank runs collectives on, in the global order (None: the world)."""
    from megatron.core import parallel_state

    groups = [None]
    if rt.tp > 1:
        groups.append(parallel_state.get_tensor_model_parallel_group())
    if rt.expert_groups:
        groups.append(parallel_state.get_expert_tensor_and_model_parallel_group())
    stages = sorted({stage for _, stage in rt.held})
    groups += [rt.stage_groups[s] for s in stages if rt.stage_groups.get(s) is not None]
    groups += [rt.expert_groups[s] for s in stages if rt.expert_groups.get(s) is not None]
    if tied and any(s in stages for s in rt.embedding_stages):
        groups.append(rt.embedding_group)
    return groups
