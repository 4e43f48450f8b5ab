"""Gradient reduction over stage replicas, and a global gradient norm that counts every parameter once.

Each function takes the main parameters per held chunk, ``{(pipeline, stage): [parameter, ...]}``
(precision.MainParams): the model's own in fp32, their fp32 copies under --fp16.

After an iteration every copy of a parameter must hold the same gradient: the sum over its copies in
all pipelines (each saw different micro-batches), averaged over data-parallel replicas. Losses are
already divided by the micro-batches per replica, so sum-then-divide-by-DP gives the global-batch mean.

When the reductions start is Megatron-LM's --overlap-grad-reduce, for every schedule. Off (its default),
every reduction starts after the schedule's last backward. On, a copy's reduction starts as soon as its
last backward is done: under our executor at the copy's R action (the lowered list places it there),
and so do each stage's experts' (with the stage's) and the tied embedding's (after its last copy's);
under megatron-core's schedules through the hooks Megatron-LM gives them (``ChunkGradSync``), the
experts and the embedding after the schedule.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.utils import clip_grads_with_norm_

from chimera_schedules.ir.channels import EMBEDDING_GROUP, reduces

from ..model.parameter_names import TIED_NAME


def _grads(params) -> list[torch.Tensor]:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


def is_expert(param) -> bool:
    """A routed expert's parameter that megatron-core reduces over expert groups, not data-parallel ones
    (it marks them ``allreduce=False``: expert parallelism, or an expert tensor-parallel size of their own)."""
    return not getattr(param, "allreduce", True)


def _gradient_buffer(params) -> torch.Tensor | None:
    """One fp32 buffer for these parameters' gradients, each ``.grad`` a view into it."""
    if not params:
        return None
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = buffer[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return buffer


class ChunkGradSync:
    """One model chunk as megatron-core's schedules see a DistributedDataParallel chunk under
    --overlap-grad-reduce; Megatron-LM's train() puts ``no_sync`` into ``config.no_sync_func`` and
    ``start_grad_sync`` into ``config.grad_sync_func``. The schedule runs all but the last backward of the
    chunk inside ``no_sync``; in a backward outside it, each parameter's post-accumulate-grad hook marks
    it ready, and once all are, the chunk's bucket starts reducing (DDP's register_grad_ready). The
    interleaved schedule (and 1F1B on stages after the first) keep ``no_sync`` on and call
    ``start_grad_sync`` instead, when the chunk's last backward is done. Anything not started is started
    by the GradSync's ``finish``, as finalize_model_grads does.

    Our own, not megatron-core's DDP, on the GPU as on the CPU: DDP moves gradients into its own
    ``param.main_grad`` buffers and frees ``param.grad``, while our optimizer, fp16/bf16 main parameters,
    clipping, norm and checkpoints read the main parameters' ``.grad`` in our per-chunk buffers (or, under
    --use-distributed-optimizer, our stage-replica shards, which megatron-core's DistributedOptimizer,
    sharding one replica's DP group, cannot hold); DDP's buffers and streams also need CUDA, so the
    equivalence tests could not run that path. One bucket per chunk: Megatron-LM's own on every chunk but
    the first pipeline rank's first (it disables bucketing on the others), and on that one too while it
    holds fewer parameters than a 40M-parameter bucket.

    The hooks run on the thread autograd runs each accumulator on: the device's for a gradient on the GPU,
    the CPU ready queue's (the thread that called backward) for a parameter handed no gradient. So that
    the start, a collective, comes from one thread, every parameter gets a gradient: under
    gradient-accumulation fusion the kernels' placeholder (precision.py, distributed_optimizer.py)."""

    def __init__(self, params: list[torch.nn.Parameter], start: Callable[[], None]):
        self.start, self.params, self.ready, self.syncing = start, {id(p) for p in params}, set(), True
        for p in params:  # after the hook that adds the gradient into its fp32 main gradient, if it has one
            p.register_post_accumulate_grad_hook(self._ready)

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def start_grad_sync(self, *unused) -> None:
        self.start()

    def reset(self) -> None:
        self.ready.clear()

    def _ready(self, param: torch.nn.Parameter) -> None:
        if self.syncing:
            self.ready.add(id(param))
            if self.ready == self.params:
                self.start()


def chunk_syncs(models, bucketed: dict, start: Callable) -> list[ChunkGradSync]:
    """A ChunkGradSync per megatron-core chunk (one pipeline: the chunk is copy (0, its stage)), over the
    model parameters whose gradient lands in ``bucketed[(0, stage)]`` (main parameters: the model's own in
    fp32, their fp32 copies under --fp16 and --bf16); ``start(key)`` begins that bucket's reduction."""
    out = []
    for m in models:
        key = (0, m.stage)
        mine = {id(p) for p in bucketed[key]}
        params = [p for p in m.parameters() if id(getattr(p, "main_param", p)) in mine]
        out.append(ChunkGradSync(params, lambda key=key: start(key)))
    return out


class ReplicaGradSync:
    """The executor's GradSync: ``start`` begins the reduction an ALLREDUCE action of the lowered list
    names, asynchronously, with --overlap-grad-reduce (eager sync, while the worker computes on): a
    stage copy's gradients over its stage's replica group; the stage's routed experts, this rank's
    copies summed, over its expert replica group (``Runtime.expert_groups``); the tied word embedding,
    its copies here summed, over the embedding group (lowering posts the last two, where it is asked to,
    after the backwards of every copy they sum; the NCCL checker proves every list's order). ``finish``
    starts what has not started, in one global order (without --overlap-grad-reduce all of it, after
    the schedule: stage copies by stage, then pipeline; experts stage by stage; the embedding last),
    waits for all, and sums the sequence-parallel norms over the tensor-parallel group.

    Each stage copy's gradients live in one persistent fp32 buffer: the main parameters' ``.grad`` are
    views into it (autograd and the fp16/bf16 hook accumulate in place, and the optimizer zeroes in
    place), so the reduction runs on the buffer itself, with no second copy; so do its experts'."""

    def __init__(self, chunks: dict, runtime, overlap: bool = False):
        self.chunks, self.rt, self.overlap = chunks, runtime, overlap
        tied = runtime.embedding_group is not None
        self.shared = [p for c in chunks.values() for p in c if tied and p.global_name == TIED_NAME]
        apart = {id(p) for p in self.shared} | {id(p) for c in chunks.values() for p in c if is_expert(p)}
        self.bucketed = {key: [p for p in c if id(p) not in apart] for key, c in chunks.items()}
        self.buffers = {key: _gradient_buffer(params) for key, params in self.bucketed.items()}
        self.experts = {key: _gradient_buffer([p for p in c if is_expert(p)]) for key, c in chunks.items()}
        # what an iteration reduces: stage copies (pipeline, stage), experts ("experts", stage), the embedding
        self.reductions = {*self.buffers, *{("experts", s) for (_, s), b in self.experts.items() if b is not None},
                           *([EMBEDDING_GROUP] if self.shared else [])}
        self.pending: list[tuple] = []
        self.started: set = set()
        self.watched: list[ChunkGradSync] = []

    def start(self, pipeline: int, stage: int, group, channel: str) -> None:
        """An ALLREDUCE action on ``channel`` (its process group ``group``): with --overlap-grad-reduce
        its reduction starts now; without it, in finish."""
        if not self.overlap:
            return
        what = reduces(channel)
        if what == "stage":
            self._reduce((pipeline, stage), group)
        elif what == "experts":
            self._reduce_experts(stage, group)
        else:
            self._reduce_tied(group)

    def chunk_syncs(self, models) -> list[ChunkGradSync] | None:
        """megatron-core's schedules' hooks under --overlap-grad-reduce (None without it)."""
        if not self.overlap:
            return None
        self.watched = chunk_syncs(models, self.bucketed,
                                   lambda key: self._reduce(key, self.rt.stage_groups.get(key[1])))
        return self.watched

    def _once(self, key) -> bool:
        """Whether ``key``'s reduction is due and not started this iteration (it is, from now)."""
        if key in self.started or key not in self.reductions:
            return False
        self.started.add(key)
        return True

    def _reduce(self, key: tuple[int, int], group) -> None:
        """Start one stage copy's all-reduce, once per iteration."""
        if self._once(key) and self.buffers[key] is not None:
            self._launch(self.buffers[key], group, [])

    def _reduce_experts(self, stage: int, group) -> None:
        """Start a stage's expert all-reduce: this rank's copies of the stage summed into the first, over
        the stage's expert replica group (each expert already summed the tokens of its whole
        expert-parallel group, whose backward returns their gradients)."""
        if self._once(("experts", stage)):
            first, *others = [b for (_, s), b in sorted(self.experts.items()) if s == stage and b is not None]
            for other in others:
                first += other
            self._launch(first, group, others)

    def _reduce_tied(self, group) -> None:
        """Start the word embedding's all-reduce: its copies here summed in place into the first copy's
        gradient, reduced over the embedding group; ``_complete`` copies it back into the others: no
        temporary the size of the embedding (a 128K vocabulary's is 512 MiB per copy at hidden 1024)."""
        if self._once(EMBEDDING_GROUP):
            first, *others = _grads(self.shared)
            for g in others:
                first += g
            self._launch(first, group, others)

    def _launch(self, summed: torch.Tensor, group, copies: list[torch.Tensor]) -> None:
        work = self.rt.all_reduce(summed, group=group, async_op=True) if group is not None else None
        self.pending.append((work, summed, copies))

    def _complete(self) -> None:
        """Wait for every started reduction; average over the data-parallel replicas; copy the result
        into this rank's other copies."""
        for work, summed, copies in self.pending:
            if work is not None:
                work.wait()
            if self.rt.replicas > 1:
                summed /= self.rt.replicas
            for other in copies:
                other.copy_(summed)
        self.pending.clear()

    def finish(self) -> None:
        """What has not started, in the global order, each group's after the last's completed (as it
        always ran: stage copies, experts stage by stage, sequence parallelism, the embedding)."""
        for pipeline, stage in sorted(self.buffers, key=lambda key: (key[1], key[0])):
            self._reduce((pipeline, stage), self.rt.stage_groups.get(stage))
        self._complete()
        for stage in sorted({stage for _, stage in self.chunks}):
            self._reduce_experts(stage, self.rt.expert_groups.get(stage))
            self._complete()
        self._sum_sequence_parallel()
        self._reduce_tied(self.rt.embedding_group)
        self._complete()
        self.started.clear()
        for chunk in self.watched:
            chunk.reset()

    def _sum_sequence_parallel(self) -> None:
        """Norms (and row-parallel biases) under sequence parallelism saw only this rank's part of the
        sequence, query and key norms only its heads: sum their gradients over the tensor-parallel
        group, as megatron-core's finalize_model_grads does."""
        grads = [p.grad for c in self.chunks.values() for p in c
                 if p.grad is not None and getattr(p, "sums_over_tensor_parallel", False)]
        if grads and self.rt.tp > 1:
            flat = _flatten_dense_tensors(grads)
            self.rt.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)


def copies(chunks: dict, runtime, tied: bool) -> dict[int, float]:
    """How many copies of each local parameter exist along the pipeline dimension, relative to the
    data-parallel replicas: a routed expert under expert parallelism has TP / (ETP x EP) times as many
    (its expert-data-parallel replicas, over the data-parallel ones)."""
    pipelines = runtime.pipelines
    per_param = {}
    for c in chunks.values():
        for p in c:
            shared = tied and p.global_name == TIED_NAME
            per_param[id(p)] = (pipelines * (len(runtime.embedding_stages) if shared else 1)
                                * (runtime.expert_share if is_expert(p) else 1))
    return per_param


def _counted_once(chunks: dict, runtime, tied: bool, of: Callable) -> tuple[list[torch.Tensor], list[float]]:
    """``of(parameter)`` for every local parameter that has it, and the weight that counts each logical
    parameter once over all ranks: a copy weighs 1/copies, a tensor-parallel duplicate (norms, row-parallel
    biases) counts on TP rank 0 only; data-parallel replicas (identical) are the caller's to divide out."""
    weight = copies(chunks, runtime, tied)
    counted = [p for c in chunks.values() for p in c
               if of(p) is not None and param_is_not_tensor_parallel_duplicate(p)]
    return [of(p).detach() for p in counted], [1.0 / weight[id(p)] for p in counted]


def global_norm(chunks: dict, runtime, tied: bool, of: Callable = lambda p: p.grad) -> float:
    """L2 norm over the whole model of ``of(parameter)`` (by default its gradient; the parameter itself for
    Megatron-LM's params norm), each logical parameter counted once (``_counted_once``)."""
    tensors, weights = _counted_once(chunks, runtime, tied, of)
    total = weighted_square_sum(tensors, weights, runtime.device)
    runtime.all_reduce(total)
    return math.sqrt(total.item() / runtime.replicas)


def global_zeros(chunks: dict, runtime, tied: bool) -> int:
    """megatron-core's count_zeros_fp32 of the whole model's gradient, each logical parameter once: run
    after the reduction, when every copy holds the summed gradient."""
    grads, weights = _counted_once(chunks, runtime, tied, lambda p: p.grad)
    total = torch.zeros((), dtype=torch.float64, device=runtime.device)
    for g, w in zip(grads, weights):
        total += (g.numel() - torch.count_nonzero(g)).double() * w
    runtime.all_reduce(total)
    return round(total.item() / runtime.replicas)


# torch's CPU norm kernel accumulates each vector lane sequentially in fp32: measured 1.9e-3 relative
# error at 30M elements (GPU kernels reduce in trees). Normed in pieces of this many elements (views, no
# copy), a CPU gradient's norm stays within fp32 rounding (about 1e-7) of the fp64 sum of squares.
CPU_NORM_PIECE = 4096


def weighted_square_sum(grads: list[torch.Tensor], weights: list[float], device) -> torch.Tensor:
    """sum_i weights[i] * |grads[i]|^2 as an fp64 scalar on ``device``, with no temporary the size of a
    gradient: fp32 norms (torch._foreach_norm, per device and dtype), squared, weighted and summed in fp64.
    Megatron-LM's fp32 norm is one multi-tensor kernel too; the fp64 sum keeps the copies' weights exact."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict = {}
    for g, w in zip(grads, weights):
        members = groups.setdefault((g.device, g.dtype), ([], []))
        members[0].append(g)
        members[1].append(w)
    for (where, _), (tensors, scales) in groups.items():
        pieces, counts = _norm_pieces(tensors)
        squares = torch.stack(torch._foreach_norm(pieces)).double().pow(2)
        per_piece = torch.tensor(scales, dtype=torch.float64, device=where).repeat_interleave(
            torch.tensor(counts, device=where))
        total += (squares * per_piece).sum().to(device)
    return total


def _norm_pieces(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors to norm, and how many of them each gradient gave: CPU ones in CPU_NORM_PIECE pieces."""
    if tensors[0].device.type != "cpu":
        return tensors, [1] * len(tensors)
    split = [t.reshape(-1).split(CPU_NORM_PIECE) for t in tensors]
    return [piece for pieces in split for piece in pieces], [len(pieces) for pieces in split]


def clip_(params: list[torch.nn.Parameter], max_norm: float, norm: float) -> None:
    """torch's clip_grads_with_norm_, given the norm ``global_norm`` (or the distributed optimizer) computed:
    the norm stays ours, summed over every rank and counting each logical parameter once, where torch's
    clip_grad_norm_ would norm this rank's gradients only. Passed as an fp64 tensor, so that torch's clip
    coefficient rounds as the Python float did."""
    if norm + 1e-6 > max_norm:  # torch scales by 1 otherwise (sparing a host sync: the norm is on the host here)
        clip_grads_with_norm_(params, max_norm, torch.tensor(norm, dtype=torch.float64))
