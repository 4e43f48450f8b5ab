"""Every NCCL communicator this rank needs, created before iteration 1.

NCCL creates a communicator on a group's first collective, and a two-rank one on a (group, pair)'s
first single send or receive: a host-blocking rendezvous. Left to iteration 1 it would happen while
other NCCL kernels are in flight, which NCCL's documentation warns can hang (NCCL_MODEL.md rule 10).
So every rank walks, before training, every process group its run uses (the world and megatron-core's
groups that its model code and MoE metrics reduce on, ``megatron_groups``; ours, ``our_groups``), one
all-reduce each, then every p2p pair of our executor's lowered lists (``warm_up_order``), one blocking
exchange each. Both walks follow one global order, each rank taking the steps it is in (the groups by
rank list, ``_walk_order``; the pairs by channel and workers), so the first unfinished step always has
all its members waiting on it: the walk cannot deadlock. On gloo it costs a few milliseconds and
changes nothing. Then ``group_guard.py`` refuses any group or pair the walk did not take.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from chimera_schedules.analysis.communicators import warm_up_order

from ..config.parallel_dims import ParallelDims


@dataclass(frozen=True)
class WarmedUp:
    """``groups``: each process group the walk created a communicator for, and its name; ``pairs``: each
    (process group, peer's rank in it) walked; ``unshared``: the communicators there would be if each of
    our groups had a process group of its own (as before setup_parallel shared them); ``names``: every
    group this rank knows, named."""

    groups: dict
    pairs: frozenset
    unshared: int
    names: dict

    @property
    def collectives(self) -> int:
        return len(self.groups)


def warm_up_communicators(rt, dims: ParallelDims, plans: list, transport) -> WarmedUp:
    """Collective: every rank calls it. ``plans``: the run's (one per global batch size under a batch-size
    ramp; the same chunks and groups on every one, their lowered lists walked one after the other, each walk
    in its global order). ``transport`` is None under megatron-core's own schedules."""
    plan = plans[0]
    megatron, ours = megatron_groups(rt, dims, plan), our_groups(rt, plan.held(rt.worker))
    roles = megatron + ours
    names = {**megatron_group_names(), **_p2p_names(rt), **_named(roles)}
    walked = _walk_order(roles)
    one = torch.zeros(1, device=rt.device)
    for group in walked:
        rt.all_reduce(one, group=group)
    pairs = [pair for each in plans if each.lowered is not None for pair in _warm_pairs(rt, transport, each.lowered)]
    unshared = len({id(group) for _, group in megatron}) + len(ours)
    return WarmedUp({group: names[group] for group in walked}, frozenset(pairs), unshared, names)


def megatron_groups(rt, dims: ParallelDims, plan) -> list[tuple[str, object]]:
    """(role, process group) for the world and every megatron-core group this rank's run uses, as
    megatron-core 0.19 reaches them in our runs: the vocab-parallel cross entropy all-reduces on the
    tensor-parallel group at any size; megatron-core's own schedules batch their pipeline p2p (our model
    configs keep its batch_p2p_comm default), which NCCL runs on the pipeline group's communicator, no
    pair's; the context-parallel groups as ``_context_parallel_groups`` says, the MoE groups as
    ``_moe_groups`` says."""
    roles = [("world", dist.group.WORLD), ("tensor-parallel", parallel_state.get_tensor_model_parallel_group())]
    if plan.schedule is None and rt.pp > 1:
        roles.append(("pipeline-parallel", parallel_state.get_pipeline_model_parallel_group()))
    return roles + _context_parallel_groups(dims) + _moe_groups(dims)


def _context_parallel_groups(dims: ParallelDims) -> list[tuple[str, object]]:
    """The attention of a sequence split over CP ranks communicates on the context-parallel group (the
    CPU's all-gather of keys and values; Transformer Engine's ring, all-to-all or all-gather), and with
    --hierarchical-context-parallel-sizes Transformer Engine's a2a+p2p on megatron-core's sub-groups too."""
    if dims.cp == 1:
        return []
    roles = [("context-parallel", parallel_state.get_context_parallel_group())]
    if dims.hierarchical_cp:
        roles += [("hierarchical context-parallel", group)
                  for group in parallel_state.get_hierarchical_context_parallel_groups()]
    return roles


def our_groups(rt, held: list[tuple[int, int]]) -> list[tuple[str, object]]:
    """(role, process group) for each of our collective groups this rank reduces on: the replica groups
    of the stages it holds (``held``: the run plan's), their expert replica groups, the embedding group."""
    stages = sorted({stage for _, stage in held})
    roles = [(f"stage {s} replica", rt.stage_groups[s]) for s in stages if rt.stage_groups.get(s) is not None]
    roles += [(f"stage {s} expert replica", rt.expert_groups[s]) for s in stages
              if rt.expert_groups.get(s) is not None]
    if len(rt.embedding_stages) > 1 and any(s in stages for s in rt.embedding_stages):
        roles.append(("embedding", rt.embedding_group))
    return roles


def _moe_groups(dims: ParallelDims) -> list[tuple[str, object]]:
    """megatron-core's MoE layers: the router sums tokens per expert over the tensor-and-context-parallel
    group (and its metrics tracker records the losses against it), the z-loss and the global aux loss over
    the tensor-data-and-context-parallel group; the tracker reduces its metrics over the pipeline and
    data-parallel groups after the flush. The dispatchers gather over expert-TP x EP (both), exchange
    tokens over EP (alltoall; flex, whose kernels set up their buffers over it), and the experts' linear layers
    and the alltoall dispatcher use expert TP."""
    if dims.num_experts is None:
        return []
    etp, ep = dims.etp, dims.ep
    roles = [("tensor-and-context-parallel", parallel_state.get_tensor_and_context_parallel_group()),
             ("pipeline-parallel", parallel_state.get_pipeline_model_parallel_group()),
             ("data-parallel", parallel_state.get_data_parallel_group())]
    if dims.moe_global_reduction:
        roles.append(("tensor-data-and-context-parallel",
                      parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)))
    if etp * ep > 1:
        roles.append(("expert-tensor-and-expert-parallel", parallel_state.get_expert_tensor_and_model_parallel_group()))
    if ep > 1 and dims.moe_dispatcher in ("alltoall", "flex"):
        roles.append(("expert-parallel", parallel_state.get_expert_model_parallel_group()))
    if etp > 1:
        roles.append(("expert-tensor-parallel", parallel_state.get_expert_tensor_parallel_group()))
    return roles


def _walk_order(roles) -> list:
    """Each group once, in one global order: by rank list, then by the index of its first role in
    ``roles``. Two groups with one rank list are the world, whose role comes first, or lie within one
    pipeline worker (megatron-core's own: at CP=1 its tensor-and-context-parallel group has the
    tensor-parallel group's ranks), whose ranks hold the same stages and so list the same roles in one
    order. Ours that span workers have rank lists of their own, or are megatron-core's (setup_parallel)."""
    first = {}
    for i, (_, group) in enumerate(roles):
        first.setdefault(group, i)
    return sorted(first, key=lambda group: (dist.get_process_group_ranks(group), first[group]))


def _warm_pairs(rt, transport, lowered) -> list[tuple]:
    """Our executor's p2p pairs, in ``warm_up_order``: (process group, peer's rank in it) per pair."""
    buffer = torch.zeros(1, dtype=transport.dtype, device=transport.comm_device or transport.device)
    pairs = []
    for name, src, dst in warm_up_order(lowered):
        if rt.worker in (src, dst):
            group, peer = transport.groups[name], transport.ranks[dst if rt.worker == src else src]
            post = transport.p2p.isend if rt.worker == src else transport.p2p.irecv
            transport.p2p.wait(post(buffer, peer, group))
            pairs.append((group, dist.get_group_rank(group, peer)))
    return pairs


def _named(roles) -> dict:
    """Each group: its roles, then its ranks ("stage 0 replica/embedding group [0, 3]")."""
    labels = {}
    for role, group in roles:
        labels.setdefault(group, []).append(role)
    return {group: f"{'/'.join(dict.fromkeys(r))} group {dist.get_process_group_ranks(group)}"
            for group, r in labels.items()}


def _p2p_names(rt) -> dict:
    """Our p2p groups (used for p2p only, they have no collective role)."""
    return {group: f"{name} p2p group {dist.get_process_group_ranks(group)}" for name, group in rt.p2p_groups.items()}


def megatron_group_names() -> dict:
    """Every megatron-core group of this rank, named after the parallel_state globals holding it (for
    the guard's message about a group the run was not expected to use)."""
    labels = {}
    for name, value in sorted(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup) and not name.endswith("_GLOO"):
            labels.setdefault(value, []).append(name.strip("_").lower().replace("_group", "").replace("_", "-"))
    return {group: f"megatron-core's {'/'.join(r)} group {dist.get_process_group_ranks(group)}"
            for group, r in labels.items()}
