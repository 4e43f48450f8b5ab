"""The pipeline: what the run plan (run_plan.py) is built from, read once from the validated flags."""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, replace

from chimera_schedules import ScheduleSpec
from chimera_schedules.ir.actions import HalvesSplit
from chimera_schedules.ir.layout import Layout

from .batch_ramp import other_batches
from .parallel_dims import ParallelDims
from .schedule_request import (
    halves_note,
    halves_split,
    microbatches,
    model_stages,
    resolved_schedule,
    schedule_request,
    stage_layout,
)


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """``schedule``: --pipeline-schedule, or Megatron-LM's choice when it is not given. ``request``: our
    executor's schedule as the flags ask it (the registry fills in its defaults), None for megatron-core's
    schedules and a single stage. ``microbatches`` per iteration and pipeline replica; ``model_stages`` per
    pipeline; ``layout``: the layers, embedding, MTP and loss each model stage holds. ``reductions``: what
    the lowered lists post beside the stage copies' gradient reductions (passes/lowering.py's ``lower``
    options). ``balanced_for``: the hardware profile --balance-pipeline-layout cut the layout for.
    ``others``: (global batch size, its pipeline) of every other batch size the run takes: a batch-size ramp's
    earlier steps, --eval-global-batch-size."""

    schedule: str
    request: ScheduleSpec | None
    microbatches: int
    model_stages: int
    layout: Layout
    reductions: dict
    balanced_for: str | None
    halves: HalvesSplit | None = None
    halves_note: str | None = None
    others: tuple[tuple[int, PipelineSpec], ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace, parallel: ParallelDims) -> PipelineSpec:
        """The pipeline at --global-batch-size, with ``others``: the pipeline of each other global batch size
        the run takes (batch_ramp.py: a ramp's earlier steps, the evaluation's), by size."""
        others = tuple((size, cls._at(_batch_of(args, size), parallel)) for _, size in other_batches(args))
        return replace(cls._at(args, parallel), others=others)

    @classmethod
    def _at(cls, args: argparse.Namespace, parallel: ParallelDims) -> PipelineSpec:
        request = schedule_request(args)
        stages = model_stages(args, request)
        layout = stage_layout(args, stages)
        return cls(schedule=resolved_schedule(args), request=request, microbatches=microbatches(args),
                   model_stages=stages, layout=layout,
                   reductions=wider_reductions(args.overlap_grad_reduce, parallel, layout),
                   balanced_for=args.balance_pipeline_layout,
                   halves=halves_split(args) if args.overlap_moe_expert_parallel_comm else None,
                   halves_note=halves_note(args))


def _batch_of(args: argparse.Namespace, size: int) -> argparse.Namespace:
    at = copy.copy(args)
    at.global_batch_size = size
    return at


def wider_reductions(overlap_grad_reduce: bool, parallel: ParallelDims, layout: Layout) -> dict:
    """With --overlap-grad-reduce, each stage's routed experts' reductions where they have groups of their
    own, and the tied word embedding's, so that they start as early as the stage copies' and the checker
    proves them; without it nothing runs before the flush."""
    if not overlap_grad_reduce:
        return {}
    return {"experts": parallel.expert_groups, "embedding_stages": layout.embedding_stages(parallel.tied_embeddings)}
