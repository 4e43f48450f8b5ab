"""The run plan: what the parsed flags ask the pipeline to do, built once from the pipeline's section
(``PipelineSpec``, pipeline_spec.py) and passed explicitly to the trainer, the process groups, the model
builder and the data source.

Parsing only checks that the request can be met (schedule_request.py's functions of the flags are pure,
and cheap); ``make_run_plan`` then generates the schedule, which for ``--chimera-order best`` means
seconds of CP-SAT search, and proves its lowered lists. How an iteration runs the plan is the trainer's
(schedule_runner.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

from chimera_schedules import Op, Schedule, ScheduleSpec, build_spec
from chimera_schedules.analysis.nccl_model import check
from chimera_schedules.ir.actions import HalvesSplit, parts
from chimera_schedules.ir.dataflow import forward_only
from chimera_schedules.ir.layout import Layout
from chimera_schedules.ir.schedule import copies_held
from chimera_schedules.passes.lowering import lower

from .parallel_dims import ParallelDims
from .pipeline_spec import PipelineSpec

# The one sound acceptance mode (NCCL_MODEL.md): every operation blocks its device's queue until it
# completes, so lists that finish here finish whatever hardware queues alias or communicators merge.
PROOF_MODE = "nccl-single-queue"


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """``schedule``: our executor's compute schedule, None for megatron-core's own (megatron-1f1b or
    megatron-interleaved, or no pipelining). ``placement[pipeline][stage]``: the worker holding that model
    stage's copy. ``microbatches`` per iteration of ``microbatch_scale`` times the user's micro-batch
    (0.5 under Chimera's halving). ``megatron_virtual_stages``: megatron-core's interleaved schedule's
    chunks per rank, for its parallel state; None otherwise (ours are in ``schedule.virtual_stages``).
    ``lowered``: what our executor posts, proven to complete under ``PROOF_MODE`` in ``proof_seconds``.
    ``layout``: which layers, embedding, MTP and loss each model stage holds, in model order.
    ``overlap`` (--overlap-moe-expert-parallel-comm): the schedule pairs forwards with backwards (and runs
    actions in halves where the micro-batch splits: ``halves_fit``), and the executor runs every chunk
    through its schedule plan; ``halves``: where a halved action cuts its micro-batch (stage.BATCH or
    stage.SEQUENCE; None without halves), ``halves_note`` the startup line saying where a micro-batch that
    does not split along its batch is cut, or why not. ``name``: the schedule the run resolved
    (--pipeline-schedule, or Megatron-LM's choice); ``balanced_for``: the hardware profile
    --balance-pipeline-layout cut the layout for, None for a layout as given."""

    schedule: Schedule | None
    placement: tuple[tuple[int, ...], ...]
    model_stages: int
    microbatches: int
    microbatch_scale: float
    split_backward: bool
    megatron_virtual_stages: int | None
    layout: Layout
    name: str
    lowered: Schedule | None = None
    proof_seconds: float | None = None
    overlap: bool = False
    halves: HalvesSplit | None = None
    halves_note: str | None = None
    balanced_for: str | None = None

    def held(self, worker: int) -> list[tuple[int, int]]:
        """The (pipeline, model stage) copies ``worker`` holds, in placement order."""
        return copies_held(self.placement, worker)

    def forward_orders(self, worker: int) -> list[list[int]]:
        """Per held chunk, its micro-batches in the order the schedule runs their forwards."""
        if self.schedule is None:
            return [list(range(self.microbatches)) for _ in self.held(worker)]
        actions = [p for a in self.schedule.workers[worker] for p in parts(a)]  # an F&B's forward too
        return [[a.mb for a in actions if a.op is Op.FORWARD and (a.pipeline, a.stage) == key]
                for key in self.held(worker)]


def make_run_plan(pipeline: PipelineSpec, parallel: ParallelDims) -> RunPlan:
    """The plan for the sections of flags ``parse_args`` accepted: generates the schedule (once per process)."""
    request, stages, layout = pipeline.request, pipeline.model_stages, pipeline.layout
    common = dict(model_stages=stages, layout=layout, name=pipeline.schedule, balanced_for=pipeline.balanced_for,
                  halves_note=pipeline.halves_note)
    if request is None:
        pp = parallel.pp
        virtual = stages // pp if pipeline.schedule == "megatron-interleaved" else None
        return RunPlan(schedule=None, placement=(tuple(s % pp for s in range(stages)),),
                       microbatches=pipeline.microbatches, microbatch_scale=1.0, split_backward=False,
                       megatron_virtual_stages=virtual, **common)
    schedule = generated(request)
    lowered, seconds = _proven(lower(schedule, **pipeline.reductions))
    return RunPlan(schedule=schedule, placement=schedule.placement, microbatches=schedule.microbatches,
                   microbatch_scale=schedule.microbatch_scale, split_backward=schedule.split_backward,
                   megatron_virtual_stages=None, lowered=lowered, proof_seconds=seconds, overlap=bool(request.overlap),
                   halves=pipeline.halves if request.halves is not False else None, **common)


def other_plans(pipeline: PipelineSpec, parallel: ParallelDims) -> dict[int, RunPlan]:
    """The plan of every other global batch size the run takes (a batch-size ramp's earlier steps, the
    evaluation's), by size, each schedule generated and proven once; empty for most runs."""
    return {size: make_run_plan(spec, parallel) for size, spec in pipeline.others}


@lru_cache(maxsize=4)
def generated(request: ScheduleSpec) -> Schedule:
    """The schedule ``schedule_request`` asked for, generated once per process: validation's rules that
    read it (the balancer, the split-backward checks) and the run plan share one (``--chimera-order best``
    searches for seconds). Schedule is frozen: its sharers read it only."""
    return build_spec(request)


def _proven(lowered: Schedule) -> tuple[Schedule, float]:
    """The lowered lists, training and forward-only (evaluation's), replayed under NCCL's rules before
    any process group exists; raises InvalidSchedule naming the wait-for cycle if they would hang."""
    start = time.perf_counter()
    check(lowered, PROOF_MODE)
    check(forward_only(lowered), PROOF_MODE)
    return lowered, time.perf_counter() - start

