"""Distributed setup: megatron-core's parallel state plus the groups a multi-pipeline schedule needs.

megatron-core owns tensor- and data-parallel groups and its own (down-direction) pipeline group.
On top of it, derived from the schedule's placement for any schedule:
- the p2p groups the lowered schedule names: one for messages to a higher worker, one for messages
  to a lower one (chimera_schedules/ir/channels.py says why), ranks in worker order;
- one replica group per model stage: every rank holding a copy of it, in any pipeline, any
  data-parallel replica and any context-parallel rank (same tensor-parallel rank) -- its gradients are
  summed there, over DP x CP as megatron-core's (its data-parallel group with context parallelism);
- the embedding group: every rank holding a copy of the word embedding (stage 0's input embedding,
  the tied output layer of the last stage, the embedding of a stage of MTP layers; in every pipeline);
- with expert parallelism, one expert replica group per model stage: every rank holding a copy of the
  same experts of that stage (same expert-parallel and expert-tensor-parallel rank), in any pipeline
  and any expert-data-parallel replica. megatron-core's expert groups (the dispatcher's) lie within one
  pipeline worker, whose ranks all run the same action list, so the dispatcher's collectives reach them
  in the same order under any schedule.
The replica and embedding groups with one rank set are one process group, so one NCCL communicator
(``_shared_groups``). Under --num-distributed-optimizer-instances K, each of these groups also splits into
K instances by data-parallel rank (megatron-core's: consecutive data-parallel ranks), one group per
instance and one per position across them (``Runtime.optimizer_groups``).
Ranks follow megatron-core's order, its default or --use-tp-pp-dp-mapping's (rank_order.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.distributed.distributed_c10d import _world

from chimera_schedules.ir.channels import P2P_GROUPS

from ..config.parallel_dims import ParallelDims
from ..model import cpu_compat
from .rank_order import RankOrder

# torch 2.13 renamed the flat collectives (*_single) and deprecated the old names, which torch 2.11 and
# earlier (a cluster's own CUDA torch) still only have: the first of the two that this torch defines.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Runtime:
    """This rank's coordinates and process groups. ``pipelines``: the model copies along the pipeline
    dimension (the run plan's placement rows: two under Chimera); which copies this rank holds is the
    plan's (``RunPlan.held``)."""

    device: torch.device
    backend: str
    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    dp_rank: int
    worker: int
    pipelines: int = 1
    cp: int = 1
    cp_rank: int = 0
    p2p_groups: dict = field(default_factory=dict)  # lowered group name -> process group
    worker_ranks: list[int] = field(default_factory=list)
    stage_groups: dict = field(default_factory=dict)
    embedding_group: object = None
    embedding_stages: tuple[int, ...] = (0,)  # the stages holding a copy of the word embedding
    expert_groups: dict = field(default_factory=dict)  # stage -> its expert replica group (expert parallelism)
    expert_share: float = 1.0  # a routed expert's replicas over a dense parameter's: TP / (ETP x EP)
    comm_device: torch.device | None = None  # host staging: collectives and p2p through a host copy
    instances: dict = field(default_factory=dict)  # a replica group's ranks -> optimizer_groups' answer

    @property
    def replicas(self) -> int:
        """The ranks over which a dense parameter's gradient is averaged, per copy of its stage: DP x CP (each
        CP rank's loss is its own share of the sequence's, as megatron-core's)."""
        return self.dp * self.cp

    def optimizer_groups(self, group) -> tuple[object, object, bool]:
        """Where the distributed optimizer shards a replica group's state: (the group of this rank's
        instance, the group across instances at this rank's position, whether this rank's instance is the
        first). One instance: (the group, None, True)."""
        if group is None or not self.instances:
            return group, None, True
        return self.instances[tuple(dist.get_process_group_ranks(group))]

    def all_reduce(self, tensor: torch.Tensor, group=None, async_op: bool = False):
        """dist.all_reduce, through host memory when staging; returns a handle with wait() if async."""
        if self.comm_device is None:
            return dist.all_reduce(tensor, group=group, async_op=async_op)
        host = tensor.to(self.comm_device, copy=True)
        work = dist.all_reduce(host, group=group, async_op=async_op)
        staged = _Staged(work, host, tensor)
        if not async_op:
            staged.wait()
        return staged

    def reduce_scatter(self, shard: torch.Tensor, flat: torch.Tensor, group):
        """In place and asynchronous: ``shard`` is this member's slice of ``flat`` (NCCL's rule for an
        in-place reduce-scatter); returns a handle with wait()."""
        if self.comm_device is None:
            return _reduce_scatter(shard, flat, group=group, async_op=True)
        host = flat.to(self.comm_device, copy=True)
        start = shard.data_ptr() - flat.data_ptr()
        host_shard = host[start // flat.element_size():][:shard.numel()]
        return _Staged(_reduce_scatter(host_shard, host, group=group, async_op=True), host_shard, shard)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
        if self.comm_device is None:
            return _all_gather(full, shard, group=group, async_op=async_op)
        host = full.to(self.comm_device, copy=True)
        staged = _Staged(_all_gather(host, shard.to(self.comm_device), group=group, async_op=async_op),
                         host, full)
        if not async_op:
            staged.wait()
        return staged


class _Staged:
    """An all-reduce on a host copy; wait() copies the result back to the device tensor."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor):
        self.work, self.host, self.target = work, host, target

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.target.copy_(self.host)


def init_distributed(backend: str | None, timeout_minutes: float,
                     host_staging: bool = False) -> tuple[str, torch.device]:
    """--distributed-backend (Megatron-LM's default, nccl) on a GPU; gloo where there is none, whatever
    the flag says, since nccl cannot run there. A lone process needs no launcher.
    ``host_staging``: compute on the GPU, communicate with gloo through host memory (several ranks
    sharing one GPU, which NCCL refuses)."""
    use_cuda = torch.cuda.is_available() and (backend != "gloo" or host_staging)
    backend = (backend or "nccl") if use_cuda and not host_staging else "gloo"
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cpu_compat.apply()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # port 0: the lone store binds any free port, so lone runs never collide
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "0"))
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
        _MADE.add(dist.group.WORLD)
    return backend, device


_MADE = set()  # the default process group, once init_distributed made it


def made_here() -> bool:
    """Whether init_distributed made the default process group (the run's to destroy at its end): the startup
    measurement of stage costs (stage_costs.py) makes it before the trainer, which keeps it."""
    return dist.is_initialized() and dist.group.WORLD in _MADE


def setup_parallel(dims: ParallelDims, plan, backend: str, device: torch.device) -> Runtime:
    """Initialise megatron-core's parallel state and the groups the run plan's placement needs
    (collective: every rank must call it with the same arguments). The world is the launcher's (the
    sizes were validated against it)."""
    tp, pp, cp = dims.tp, dims.pp, dims.cp
    world = dist.get_world_size()
    dp = world // (tp * cp * pp)
    order = RankOrder(tp, dp, pp, dims.tp_pp_dp_mapping, cp)
    _initialize_megatron_core(dims, plan, order)
    timeout = dims.timeout_minutes
    rank = dist.get_rank()
    rank_of = order.rank
    tp_rank, dp_rank, worker = order.coords(rank)
    cp_rank = order.cp_rank(rank)
    mine = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    assert mine == [rank_of(tp_rank, dp_rank, w, cp_rank) for w in range(pp)], "unexpected megatron-core rank order"

    placement = plan.placement
    rt = Runtime(device, backend, rank, world, tp, pp, dp, tp_rank, dp_rank, worker, len(placement), cp, cp_rank,
                 worker_ranks=[rank_of(tp_rank, dp_rank, w, cp_rank) for w in range(pp)],
                 comm_device=torch.device("cpu") if backend == "gloo" and device.type == "cuda" else None)
    stages = len(placement[0])
    rt.embedding_stages = plan.layout.embedding_stages(dims.tied_embeddings)
    # Every rank creates every group, in the same order; each keeps the ones it belongs to. A group
    # does not inherit init_process_group's timeout (gloo's default is 30 min): pass it explicitly.
    # The p2p groups are each their own (one direction each, channels.py); the collective ones are one
    # process group per rank set (``_shared_groups``).
    p2p_group = lambda ranks: dist.new_group(ranks, timeout=timedelta(minutes=timeout))  # noqa: E731
    new_group = _shared_groups(timeout, cp)
    copies = [(d, c) for d in range(dp) for c in range(cp)]  # a dense parameter's copies per pipeline worker
    for t in range(tp):
        for d, c in copies:
            for name in P2P_GROUPS:
                group = p2p_group([rank_of(t, d, w, c) for w in range(pp)])
                if (t, d, c) == (tp_rank, dp_rank, cp_rank):
                    rt.p2p_groups[name] = group
        for s in range(stages):
            ranks = sorted({rank_of(t, d, row[s], c) for row in placement for d, c in copies})
            group = new_group(ranks) if len(ranks) > 1 else None
            _split_instances(rt, ranks, lambda r: order.coords(r)[1], dp, dims.optimizer_instances, new_group)
            if t == tp_rank:
                rt.stage_groups[s] = group
        if len(rt.embedding_stages) > 1:
            ranks = sorted({rank_of(t, d, row[s], c) for row in placement for s in rt.embedding_stages
                            for d, c in copies})
            group = new_group(ranks)
            _split_instances(rt, ranks, lambda r: order.coords(r)[1], dp, dims.optimizer_instances, new_group)
            if t == tp_rank:
                rt.embedding_group = group
    if dims.expert_groups:
        _expert_groups(rt, dims, order, placement, new_group)
    return rt


def _initialize_megatron_core(dims: ParallelDims, plan, order: RankOrder) -> None:
    """megatron-core's parallel state for these sizes, its ranks in ``order``'s order."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(dims.tp, dims.pp,
                                             virtual_pipeline_model_parallel_size=plan.megatron_virtual_stages,
                                             context_parallel_size=dims.cp,
                                             hierarchical_context_parallel_sizes=dims.hierarchical_cp,
                                             distributed_timeout_minutes=dims.timeout_minutes,
                                             expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp,
                                             create_gloo_process_groups=dims.gloo_groups,
                                             order=order.megatron_order)


def _split_instances(rt: Runtime, ranks: list[int], dp_of, dp: int, k: int, new_group) -> None:
    """The groups of one replica group (``ranks``) under K optimizer instances: instance i holds the
    members whose data-parallel rank (``dp_of``, of ``dp``) lies in the i-th K-th of them; the group
    across instances pairs each instance's j-th member, which holds the same shard. Collective as
    ``new_group``; records the groups in ``rt.instances`` on the members."""
    if k == 1:
        return
    parts = [[r for r in ranks if dp_of(r) // (dp // k) == i] for i in range(k)]
    assert all(len(part) == len(parts[0]) for part in parts), f"replica group {ranks} splits unevenly into {k}"
    within = [new_group(part) if len(part) > 1 else None for part in parts]
    across = [new_group(list(column)) for column in zip(*parts)]
    for i, part in enumerate(parts):
        if rt.rank in part:
            rt.instances[tuple(ranks)] = (within[i], across[part.index(rt.rank)], i == 0)


def _shared_groups(timeout: float, cp: int):
    """``new_group(ranks)`` for our collective groups: one process group, so one NCCL communicator, per
    rank set. Under Chimera stage s, stage D-1-s and the embedding group have the same ranks: three
    communicators over the same ranks otherwise; the lowered lists post the stages' reductions (and,
    under --overlap-grad-reduce, the embedding's and the experts') in one order on every member (the
    NCCL checker replays them on one queue). A rank set megatron-core has a
    group for reuses it: its pipeline-parallel group (a stage every pipeline rank holds; the embedding
    group at PP=2), its data-parallel group (a stage one worker holds; with context parallelism, its
    data-parallel group with CP), its expert-data-parallel group.
    megatron-core posts on those only its MoE metrics after the flush and, the pipeline group under its
    own schedules, the flush's batched p2p, which precede ours there (the embedding's reduction, after
    the flush) on both members. Every rank makes the same calls in the same order (dist.new_group is
    collective over the world), so every rank must know every megatron-core rank set: one
    all_gather_object first. Our rank lists are sorted, as megatron-core's are."""
    mine = {}
    groups = [parallel_state.get_pipeline_model_parallel_group(),
              parallel_state.get_data_parallel_group(with_context_parallel=cp > 1),
              parallel_state.get_expert_data_parallel_group()]
    for group in groups:
        mine[tuple(dist.get_process_group_ranks(group))] = group
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(mine))
    theirs = {ranks for listed in everyone for ranks in listed}
    made = {}

    def new_group(ranks: list[int]):
        key = tuple(ranks)
        if key in theirs:
            return mine.get(key, dist.GroupMember.NON_GROUP_MEMBER)
        if key not in made:
            made[key] = dist.new_group(ranks, timeout=timedelta(minutes=timeout))
        return made[key]

    return new_group


def _expert_groups(rt: Runtime, dims: ParallelDims, order: RankOrder, placement, new_group) -> None:
    """One expert replica group per stage. Within a pipeline worker megatron-core orders the TP x CP x DP
    ranks (``RankOrder.in_worker``) as expert-TP fastest, then EP, then expert-DP (so EP may span CP ranks);
    the assert holds it to that."""
    etp, ep = dims.etp, dims.ep
    per_worker = rt.tp * rt.cp * rt.dp
    edp = per_worker // (etp * ep)
    rt.expert_share = rt.tp / (etp * ep)
    local = lambda e, x, d: e + etp * (x + ep * d)  # noqa: E731  (expert-TP, EP, expert-DP rank)
    mine = order.index_in_worker(rt.rank)
    coords = (mine % etp, (mine // etp) % ep)
    expected = [order.in_worker(local(*coords, d), rt.worker) for d in range(edp)]
    assert dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()) == expected, \
        "unexpected megatron-core expert rank order"
    # The dispatcher's collectives run inside F and B on these groups: every member must hold the same
    # pipeline worker, so that it runs the same action list (the ranks agree on the schedule's hash).
    for group in (parallel_state.get_expert_model_parallel_group(),
                  parallel_state.get_expert_tensor_and_model_parallel_group()):
        assert {order.coords(r)[2] for r in dist.get_process_group_ranks(group)} == {rt.worker}, \
            "an expert group spans pipeline workers"
    for e in range(etp):
        for x in range(ep):
            for s in range(len(placement[0])):
                ranks = sorted({order.in_worker(local(e, x, d), row[s]) for row in placement for d in range(edp)})
                group = new_group(ranks) if len(ranks) > 1 else None
                _split_instances(rt, ranks, lambda r: order.index_in_worker(r) // (etp * ep), edp,
                                 dims.optimizer_instances, new_group)
                if (e, x) == coords:
                    rt.expert_groups[s] = group


def release_groups(rt: Runtime) -> None:
    """Destroy every process group but the default one, and drop this runtime's references to them.
    Each gloo group keeps threads that poll (about 6% of a core per group on the 2-core CI machine), so
    a process that builds trainer after trainer (benchmarks, test harnesses) must free them."""
    parallel_state.destroy_model_parallel()
    rt.p2p_groups.clear()
    rt.stage_groups.clear()
    rt.expert_groups.clear()
    rt.embedding_group = None
    rt.instances.clear()
    for group in list(_world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
