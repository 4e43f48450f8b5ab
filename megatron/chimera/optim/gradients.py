"""Gradient reduction over stage replicas, and a global gradient norm that counts every parameter once.

Each function takes the main parameters per held chunk, ``{(pipeline, stage): [parameter, ...]}``
(precision.MainParams): the model's own in fp32, their fp32 copies under --fp16.

After an iteration every copy of a parameter must hold the same gradient: the sum over its copies in
all pipelines (each saw different micro-batches), averaged over data-parallel replicas. Losses are
already divided by the micro-batches per replica, so sum-then-divide-by-DP gives the global-batch mean.
"""
from __future__ import annotations

import math

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..model.chunk import TIED_NAME


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


class ReplicaGradSync:
    """The executor's GradSync: ``start`` all-reduces one stage copy's gradients asynchronously over the
    group the lowered schedule names, its stage's replica group (eager sync, while the worker computes
    on); ``finish`` waits for them, then sums the tied word embedding over all of its copies (input
    embeddings and output layers), and, with expert parallelism, each stage's routed experts over its
    expert replica group (``Runtime.expert_groups``), stage by stage in one global order. Those two
    run after the lowered lists, so the collectives the checker proved stay the only ones in flight.

    Each stage copy's gradients live in one persistent fp32 buffer: the main parameters' ``.grad`` are
    views into it (autograd and the fp16/bf16 hook accumulate in place, and the optimizer zeroes in
    place), so the reduction runs on the buffer itself, with no second copy."""

    def __init__(self, chunks: dict, runtime):
        self.chunks, self.rt = chunks, runtime
        tied = runtime.embedding_group is not None
        self.shared = [p for c in chunks.values() for p in c if tied and p.global_name == TIED_NAME]
        apart = {id(p) for p in self.shared} | {id(p) for c in chunks.values() for p in c if is_expert(p)}
        self.buffers = {key: _gradient_buffer([p for p in c if id(p) not in apart]) for key, c in chunks.items()}
        self.experts = {key: _gradient_buffer([p for p in c if is_expert(p)]) for key, c in chunks.items()}
        self.pending: list = []

    def start(self, pipeline: int, stage: int, group) -> None:
        buffer = self.buffers[(pipeline, stage)]
        if buffer is None:
            return
        work = self.rt.all_reduce(buffer, group=group, async_op=True) if group is not None else None
        self.pending.append((work, buffer))

    def finish(self) -> None:
        for work, buffer in self.pending:
            if work is not None:
                work.wait()
            if self.rt.dp > 1:
                buffer /= self.rt.dp
        self.pending.clear()
        self._sum_experts()
        self._sum_sequence_parallel()
        if self.shared:
            total = torch.stack(_grads(self.shared)).sum(0)
            self.rt.all_reduce(total, group=self.rt.embedding_group)
            if self.rt.dp > 1:
                total /= self.rt.dp
            for p in self.shared:
                p.grad.copy_(total)

    def _sum_experts(self) -> None:
        """Each stage's expert gradients: this rank's copies of the stage summed, then over the stage's
        expert replica group, averaged over the data-parallel replicas (each expert already summed the
        tokens of its whole expert-parallel group, whose backward returns their gradients)."""
        for stage in sorted({stage for _, stage in self.chunks}):
            mine = [b for (_, s), b in sorted(self.experts.items()) if s == stage and b is not None]
            if not mine:
                continue
            for other in mine[1:]:
                mine[0] += other
            group = self.rt.expert_groups.get(stage)
            if group is not None:
                self.rt.all_reduce(mine[0], group=group)
            if self.rt.dp > 1:
                mine[0] /= self.rt.dp
            for other in mine[1:]:
                other.copy_(mine[0])

    def _sum_sequence_parallel(self) -> None:
        """Norms (and row-parallel biases) under sequence parallelism saw only this rank's part of the
        sequence, query and key norms only its heads: sum their gradients over the tensor-parallel
        group, as megatron-core's finalize_model_grads does."""
        from megatron.core import parallel_state

        grads = [p.grad for c in self.chunks.values() for p in c
                 if p.grad is not None and getattr(p, "sums_over_tensor_parallel", False)]
        if grads and self.rt.tp > 1:
            flat = _flatten_dense_tensors(grads)
            self.rt.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)

    def reduce_all(self) -> None:
        """For schedules that do not post R actions themselves (megatron-core's): reduce everything."""
        for pipeline, stage in self.chunks:
            self.start(pipeline, stage, self.rt.stage_groups.get(stage))
        self.finish()


def copies(chunks: dict, runtime, tied: bool) -> dict[int, float]:
    """How many copies of each local parameter exist along the pipeline dimension, relative to the
    data-parallel replicas: a routed expert under expert parallelism has TP / (ETP x EP) times as many
    (its expert-data-parallel replicas, over the data-parallel ones)."""
    pipelines = len(runtime.placement)
    per_param = {}
    for c in chunks.values():
        for p in c:
            shared = tied and p.global_name == TIED_NAME
            per_param[id(p)] = (pipelines * (len(runtime.embedding_stages) if shared else 1)
                                * (runtime.expert_share if is_expert(p) else 1))
    return per_param


def global_grad_norm(chunks: dict, runtime, tied: bool) -> float:
    """L2 norm of the gradient of the whole model, each logical parameter counted once: a copy weighs
    1/copies, a tensor-parallel duplicate (norms, row-parallel biases) counts on TP rank 0 only, and
    data-parallel replicas (identical after the reduction) are divided out."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    weight = copies(chunks, runtime, tied)
    total = torch.zeros((), dtype=torch.float64, device=runtime.device)
    for c in chunks.values():
        for p in c:
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                total += p.grad.detach().double().pow(2).sum() / weight[id(p)]
    runtime.all_reduce(total)
    return math.sqrt(total.item() / runtime.dp)


def clip_(chunks: dict, max_norm: float, norm: float) -> None:
    coeff = max_norm / (norm + 1e-6)
    if coeff < 1.0:
        for c in chunks.values():
            for p in c:
                if p.grad is not None:
                    p.grad.mul_(coeff)
