"""--use-distributed-optimizer: Megatron's distributed optimizer, sharded over each stage's replica group.

Every copy of a stage ends an iteration with the same gradient, so its copies (pipelines x data-parallel
replicas, the ranks of the stage's replica group) need one optimizer state between them, not one each.
Per rank, a stage's copy accumulates its gradient into one flat fp32 buffer; the rank's 1/G slice of it
(G the group's size) is its shard. A reduce-scatter (started as soon as the copy's last backward ends
with --overlap-grad-reduce, after the schedule without it) leaves the group's sum in each shard; each
rank steps only the parameter pieces inside its shard (their fp32 main weights and AdamW moments exist
only there), and an all-gather gives every copy the updated weights. The word embedding's copies (the
first stage's, the tied output layer, a stage of MTP layers) are one more bucket over their group, and so
are each stage's routed experts under expert parallelism, over the stage's expert replica group (their
copies: the same experts in every pipeline and expert-data-parallel replica); with --overlap-grad-reduce
their reduce-scatters start at their ALLREDUCE actions too (gradients.py says where lowering puts them). Under
--num-distributed-optimizer-instances K (Megatron's partial distributed optimizer) each group splits
into K instances by data-parallel rank: the shards are over the rank's instance, and one all-reduce of
the shard across the instances follows the reduce-scatter (process_groups.py builds the groups).

Why not megatron-core's DistributedOptimizer: it shards over the data-parallel group of one model
replica, so it cannot see the second copy of a stage, which lives on another pipeline rank. torch's
ZeroRedundancyOptimizer assigns whole parameters to ranks (uneven shards) and expects all-reduced
gradients. The two collectives here (an in-place reduce-scatter and an all-gather, under the names
process_groups.py picks for the installed torch) are torch's own and run on gloo and NCCL.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from chimera_schedules.ir.channels import EMBEDDING_GROUP, expert_group, stage_group

from ..model.parameter_names import TIED_NAME
from .adam import adam_state
from .gradients import ChunkGradSync, chunk_syncs, clip_, is_expert, weighted_square_sum
from .precision import half_weights_norm, unfused_gradient


class _Bucket:
    """Parameters whose copies live on the ranks of ``group`` (None: this rank alone). ``copies`` are
    this rank's copies, each the same parameters in the same order; they share one gradient buffer.
    Under several optimizer instances the shards are over this rank's instance of the group, and
    ``across`` (the same shard in the other instances) sums them; ``counted``: this rank's instance is
    the first, whose shards the norms count."""

    def __init__(self, copies: list[list[torch.nn.Parameter]], group, rt):
        group, self.across, self.counted = rt.optimizer_groups(group)
        self.copies, self.group, self.rt = copies, group, rt
        members = 1 if group is None else dist.get_world_size(group)
        numel = sum(p.numel() for p in copies[0])
        self.shard_size = -(-numel // members)
        self.start = (0 if group is None else dist.get_rank(group)) * self.shard_size
        self.grad = torch.zeros(self.shard_size * members, dtype=torch.float32, device=rt.device)
        self.shard_grad = self.grad[self.start:self.start + self.shard_size]
        self.weights = _flat_weights(copies[0], self.shard_size * members)
        self.pieces = list(self._pieces(copies[0]))
        for copy in copies:
            self._accumulate_into_buffer(copy)
        self.work = self.gathering = None

    def _pieces(self, params):
        """The parts of the parameters inside this rank's shard, as fp32 parameters the optimizer steps
        (views of the model's own weights in fp32, copies of them in fp16 or bf16)."""
        offset, end = 0, self.start + self.shard_size
        for p in params:
            a, b = max(offset, self.start), min(offset + p.numel(), end)
            if a < b:
                flat = p.detach().view(-1)[a - offset:b - offset]
                piece = torch.nn.Parameter(flat if p.dtype == torch.float32 else flat.float())
                piece.grad = self.grad[a:b]
                piece.source, piece.span, piece.at = p, (a - offset, b - offset), a - self.start
                yield piece
            offset += p.numel()

    def _accumulate_into_buffer(self, params) -> None:
        """Each parameter's ``main_grad`` is its view of the bucket's buffer: where the hook adds its
        gradient, and where the fused weight-gradient kernels add it themselves (gradient-accumulation
        fusion, which then flag ``grad_added_to_main_grad`` for the hook)."""
        offset = 0
        for p in params:
            p.main_grad = self.grad[offset:offset + p.numel()].view_as(p)
            p.grad_added_to_main_grad = False
            p.register_post_accumulate_grad_hook(_accumulate)
            offset += p.numel()

    def reduce(self) -> None:
        if self.group is not None:
            self.work = self.rt.reduce_scatter(self.shard_grad, self.grad, self.group)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.across is not None:
            self.rt.all_reduce(self.shard_grad, group=self.across)
        if self.rt.replicas > 1:
            self.shard_grad /= self.rt.replicas

    @torch.no_grad()
    def start_gather(self) -> None:
        """Start giving every copy the updated weights: the first copy's weights live in one flat
        buffer, whose shard holds this rank's pieces (fp32: they are views of it; bf16, fp16: rounded
        into it here), gathered in place from the other members; ``finish_gather`` waits, then copies
        them into this rank's other copies (the tied embedding's second end)."""
        shard = self.weights[self.start:self.start + self.shard_size]
        for piece in self.pieces:
            if piece.source.dtype != torch.float32:
                shard[piece.at:piece.at + piece.numel()].copy_(piece)
        work = None if self.group is None else self.rt.all_gather(self.weights, shard, self.group, async_op=True)
        self.gathering = (work,)

    @torch.no_grad()
    def finish_gather(self) -> None:
        if self.gathering is None:
            return
        work, = self.gathering
        self.gathering = None
        if work is not None:
            work.wait()
        for copy in self.copies[1:]:
            offset = 0
            for p in copy:
                p.view(-1).copy_(self.weights[offset:offset + p.numel()])
                offset += p.numel()

    def _gathered(self, shard: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return shard
        full = torch.empty(self.grad.numel(), dtype=shard.dtype, device=shard.device)
        self.rt.all_gather(full, shard, self.group)
        return full

    @torch.no_grad()
    def full_state(self, optimizer, names: tuple[str, ...]) -> dict[int, dict[str, torch.Tensor]]:
        """Collective over the group: each named state of every parameter, whole (for checkpoints)."""
        out = {id(p): {} for copy in self.copies for p in copy}
        for name in names:
            shard = torch.zeros(self.shard_size, dtype=torch.float32, device=self.rt.device)
            for piece in self.pieces:
                value = piece if name == "fp32_param" else optimizer.state[piece][name]
                shard[piece.at:piece.at + piece.numel()].copy_(value)
            full, offset = self._gathered(shard), 0
            for i, p in enumerate(self.copies[0]):
                whole = full[offset:offset + p.numel()].view_as(p).clone()
                for copy in self.copies:
                    out[id(copy[i])][name] = whole
                offset += p.numel()
        return out


@torch.no_grad()
def _flat_weights(params, size: int) -> torch.Tensor:
    """One buffer for the parameters' weights, each parameter a view of it (as megatron-core's
    parameter buffers), so the weight all-gather writes them in place."""
    flat = torch.zeros(size, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        flat[offset:offset + p.numel()].copy_(p.view(-1))
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def _holds(chunk, ids: set) -> bool:
    return any(id(p) in ids for p in chunk.parameters())


def _holding_parameters(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """Where a forward that reads the chunk's weights begins: the chunk, and every module holding parameters of
    its own, as megatron-core's DDP hooks them. megatron-core's schedule plans (--overlap-moe-expert-parallel-comm)
    run a chunk's submodules and never call the chunk."""
    return [m for m in chunk.modules() if m is chunk or next(m.parameters(recurse=False), None) is not None]


def _finish(buckets) -> None:
    for bucket in buckets:
        bucket.finish_gather()


def _accumulate(param: torch.nn.Parameter) -> None:
    grad = unfused_gradient(param)
    if grad is not None:
        param.main_grad.add_(grad)
    param.grad, param.grad_added_to_main_grad = None, False


class ShardedMainParams:
    """What the trainer steps under --use-distributed-optimizer: the pieces of every bucket in this
    rank's shards. Also the executor's GradSync: ``start`` reduce-scatters a bucket (a stage's, its
    experts', the tied embedding's) at its ALLREDUCE action with --overlap-grad-reduce, after the
    schedule without it (gradients.py says when, for every schedule)."""

    def __init__(self, chunks: dict, rt, tied: bool, overlap_reduce: bool = False, overlap_gather: bool = False):
        self.chunks, self.rt, self.tied = chunks, rt, tied
        self.overlap_reduce, self.overlap_gather = overlap_reduce, overlap_gather
        self.started: set[str] = set()
        self.watched: list[ChunkGradSync] = []
        shared = [p for c in chunks.values() for p in c.parameters() if tied and p.global_name == TIED_NAME]
        shared_ids = {id(p) for p in shared}
        self.stages: dict[int, _Bucket] = {}
        self.experts: dict[int, _Bucket] = {}
        # Blocking collectives (gather, checkpoints) follow one global order, by stage, then experts by
        # stage, then the tied embedding: two ranks that share several groups never wait on each other
        # in opposite orders.
        for (_, stage), chunk in sorted(chunks.items(), key=lambda kv: kv[0][1]):
            assert stage not in self.stages, "a rank holds two copies of one stage"
            params = [p for p in chunk.parameters() if id(p) not in shared_ids and not is_expert(p)]
            self.stages[stage] = _Bucket([params], rt.stage_groups.get(stage), rt)
            experts = [p for p in chunk.parameters() if is_expert(p)]
            if experts:
                self.experts[stage] = _Bucket([experts], rt.expert_groups.get(stage), rt)
        self.tied = _Bucket([[p] for p in shared], rt.embedding_group, rt) if shared else None
        self.buckets = [*self.stages.values(), *self.experts.values(), *([self.tied] if self.tied else [])]
        # the lowered lists' channel of each bucket: its ALLREDUCE action starts it (--overlap-grad-reduce)
        self.reductions = {**{stage_group(s): b for s, b in self.stages.items()},
                           **{expert_group(s): b for s, b in self.experts.items()},
                           **({EMBEDDING_GROUP: self.tied} if self.tied else {})}
        self.half = any(p.dtype != torch.float32 for c in chunks.values() for p in c.parameters())
        if overlap_gather:
            for (_, stage), chunk in chunks.items():
                users = [self.stages[stage], *([self.experts[stage]] if stage in self.experts else []),
                         *([self.tied] if self.tied and _holds(chunk, shared_ids) else [])]
                for module in _holding_parameters(chunk):
                    module.register_forward_pre_hook(lambda module, inputs, users=users: _finish(users))

    def all(self) -> list[torch.nn.Parameter]:
        return [piece for b in self.buckets for piece in b.pieces]

    def stepped(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """What this rank's optimizer steps, each beside the model parameter it is cut from: the pieces of its
        shards."""
        return [(piece.source, piece) for piece in self.all()]

    def _counted(self) -> list[torch.nn.Parameter]:
        """The pieces the norms sum over all ranks: every element of every logical parameter once
        (tensor-parallel duplicates on TP rank 0 only, the first optimizer instance's shards only)."""
        return [piece for b in self.buckets if b.counted for piece in b.pieces
                if param_is_not_tensor_parallel_duplicate(piece.source)]

    # --- GradSync ---------------------------------------------------------------------------------
    def start(self, pipeline: int, stage: int, group, channel: str) -> None:
        """An ALLREDUCE action on ``channel``: with --overlap-grad-reduce its bucket's reduce-scatter
        starts now (a stage's, its experts', the tied embedding's; each over the bucket's own group)."""
        if self.overlap_reduce:
            self._reduce(channel)

    def chunk_syncs(self, models) -> list[ChunkGradSync] | None:
        """megatron-core's schedules' hooks under --overlap-grad-reduce (None without it)."""
        if not self.overlap_reduce:
            return None
        bucketed = {(0, stage): bucket.copies[0] for stage, bucket in self.stages.items()}
        self.watched = chunk_syncs(models, bucketed, lambda key: self._reduce(stage_group(key[1])))
        return self.watched

    def _reduce(self, channel: str) -> None:
        if channel in self.reductions and channel not in self.started:
            self.started.add(channel)
            self.reductions[channel].reduce()

    def finish(self) -> None:
        """The reduce-scatters not started yet (all of them without --overlap-grad-reduce), in the global
        order: the stages' together, then the experts' and the tied embedding's one at a time (as they
        always ran), each bucket waited for in that order."""
        for stage in self.stages:
            self._reduce(stage_group(stage))
        for bucket in self.stages.values():
            bucket.wait()
        for channel in [*map(expert_group, self.experts), *([EMBEDDING_GROUP] if self.tied else [])]:
            self._reduce(channel)
            self.reductions[channel].wait()
        self.started.clear()
        for chunk in self.watched:
            chunk.reset()
        self._sum_over_tensor_parallel()

    def _sum_over_tensor_parallel(self) -> None:
        """As ReplicaGradSync: parameters that saw only this rank's sequence part or heads. Every TP rank
        has the same pieces (same shapes, same shard index)."""
        grads = [p.grad for p in self.all() if getattr(p.source, "sums_over_tensor_parallel", False)]
        if grads and self.rt.tp > 1:
            flat = torch.cat(grads)
            self.rt.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()])
                offset += g.numel()

    # --- the step ---------------------------------------------------------------------------------
    def zero_grad(self, optimizer) -> None:
        for bucket in self.buckets:
            bucket.grad.zero_()

    def grad_norm(self) -> float:
        return self._norm(lambda piece: piece.grad)

    def params_norm(self) -> float:
        """Megatron-LM's calc_params_l2_norm: the main weights, as ``grad_norm``; under --fp16 the fp16 weights
        themselves, normed in fp32 once the pending gathers have landed in them."""
        if any(piece.source.dtype == torch.float16 for piece in self.all()):
            self.flush()
            return half_weights_norm(self.chunks, self.rt, self.tied)
        return self._norm(lambda piece: piece.detach())

    def _norm(self, of) -> float:
        """The L2 norm of ``of(piece)`` over the model: each element of each logical parameter lives in one
        shard per optimizer instance, so it is one sum over all ranks of the counted pieces."""
        tensors = [of(piece) for piece in self._counted()]
        total = weighted_square_sum(tensors, [1.0] * len(tensors), self.rt.device)
        self.rt.all_reduce(total)
        return math.sqrt(total.item())

    def zeros(self) -> int:
        """megatron-core's count_zeros_fp32 over the shards (its distributed optimizer's: the whole world)."""
        total = torch.zeros((), dtype=torch.int64, device=self.rt.device)
        for piece in self._counted():
            total += piece.grad.numel() - torch.count_nonzero(piece.grad)
        self.rt.all_reduce(total)
        return int(total.item())

    def clip(self, max_norm: float, norm: float) -> None:
        clip_(self.all(), max_norm, norm)

    def unscale(self, scale: float) -> None:
        for piece in self.all():
            piece.grad.mul_(1.0 / scale)

    def copy_to_model(self) -> None:
        """All buckets' gathers start in one global order; with --overlap-param-gather each finishes
        at its chunk's next forward (Megatron's forward pre-hook), overlapping the next iteration's
        first forwards, otherwise here."""
        for bucket in self.buckets:
            bucket.start_gather()
        if not self.overlap_gather:
            self.flush()

    def flush(self) -> None:
        """Finish pending weight gathers: before anything reads the weights but a forward."""
        _finish(self.buckets)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        for piece in self.all():
            if piece.source.dtype != torch.float32:
                piece.copy_(piece.source.view(-1)[piece.span[0]:piece.span[1]])

    # --- checkpoints ------------------------------------------------------------------------------
    def full_state(self, optimizer, names: tuple[str, ...]) -> dict[int, dict[str, torch.Tensor]]:
        out = {}
        for bucket in self.buckets:
            out.update(bucket.full_state(optimizer, names))
        return out

    @torch.no_grad()
    def load_full_state(self, optimizer, states: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        for piece in self.all():
            whole = {name: t.reshape(-1)[piece.span[0]:piece.span[1]] for name, t in states[id(piece.source)].items()}
            optimizer.state[piece] = adam_state(optimizer, piece, step, whole["exp_avg"].clone(),
                                                whole["exp_avg_sq"].clone())
            if "fp32_param" in whole and piece.source.dtype != torch.float32:
                piece.copy_(whole["fp32_param"])

    # --- memory -----------------------------------------------------------------------------------
    def state_bytes(self) -> tuple[int, int]:
        """(main parameters, gradients) in bytes: fp32 pieces that are copies, and the buffers."""
        main = sum(p.numel() * 4 for p in self.all() if p.source.dtype != torch.float32)
        return main, sum(b.grad.numel() * 4 for b in self.buckets)
