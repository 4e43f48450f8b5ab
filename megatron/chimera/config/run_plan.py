"""The run plan: what the parsed flags ask the pipeline to do, built once and passed explicitly to the
trainer, the process groups, the model builder and the data source.

Parsing only checks that the request can be met (``schedule_request`` and ``model_stages`` are pure
functions of the flags, and cheap); ``make_run_plan`` then generates the schedule, which for
``--chimera-order best`` means seconds of CP-SAT search.

Our schedules run through the schedule executor, which posts the gradient reductions itself.
megatron-core's own schedules and no pipelining run ``get_forward_backward_func`` behind the same
``runner``, with the GradSync's hooks in their config as Megatron-LM's train() sets them, and its
``finish`` afterwards (finalize_model_grads' place), so nothing downstream asks which kind it has.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

from megatron.core.pipeline_parallel import get_forward_backward_func

from chimera_schedules import Op, Schedule, ScheduleSpec, build_spec
from chimera_schedules.analysis.nccl_model import check
from chimera_schedules.ir import layout as layouts
from chimera_schedules.ir.actions import parts
from chimera_schedules.ir.dataflow import forward_only
from chimera_schedules.ir.layout import Layout
from chimera_schedules.ir.schedule import copies_held
from chimera_schedules.ir.spec import OPTION, SHARED
from chimera_schedules.passes.lowering import lower
from chimera_schedules.registry import REGISTRY
from chimera_schedules.runtime.executor import make_forward_backward

from .parallel_dims import ParallelDims

MEGATRON_SCHEDULES = ("megatron-1f1b", "megatron-interleaved")
INTERLEAVED = ("interleaved", "megatron-interleaved")  # megatron's round-robin placement of v chunks per rank
# The one sound acceptance mode (NCCL_MODEL.md): every operation blocks its device's queue until it
# completes, so lists that finish here finish whatever hardware queues alias or communicators merge.
PROOF_MODE = "nccl-single-queue"


@dataclass(frozen=True)
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
    through its schedule plan. ``name``: the schedule the run resolved
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

    def runner(self, models, transport, grad_sync, observer=None, nvtx_ranges: bool = False):
        """The iteration's forward_backward function, megatron-core's keyword signature. ``transport``
        (ours only) carries the messages; ``observer`` (the executor's Observer protocol: the trainer's
        hooks) sees our actions; ``nvtx_ranges`` (--nvtx-ranges) gives each of our actions an NVTX range
        on a GPU."""
        if self.lowered is not None:
            return make_forward_backward(self.lowered, transport, grad_sync, observer, nvtx_ranges,
                                         schedule_plans=self.overlap)
        return _megatron_core_runner(models, grad_sync, self.megatron_virtual_stages)


def _megatron_core_runner(models, grad_sync, virtual_stages: int | None):
    if virtual_stages:  # how megatron-core's interleaved schedule tells the last virtual stage
        for m in models:
            m.config.virtual_pipeline_model_parallel_size = virtual_stages
    _overlap_grad_reduce(models, grad_sync)
    schedule = get_forward_backward_func()

    def forward_backward(**kwargs):
        reports = schedule(**kwargs)
        if not kwargs["forward_only"]:
            grad_sync.finish()  # what has not started yet (everything without --overlap-grad-reduce)
        return reports

    return forward_backward


def _overlap_grad_reduce(models, grad_sync) -> None:
    """Megatron-LM's train() with --overlap-grad-reduce (and its default --align-grad-reduce): each
    chunk's ``no_sync`` in config.no_sync_func, its ``start_grad_sync`` in config.grad_sync_func, a list
    for several chunks (gradients.ChunkGradSync). config.param_sync_func stays unset: with
    --overlap-param-gather our weight gathers start right after the step, and each chunk's forward
    pre-hook waits for its own (distributed_optimizer.py)."""
    chunks = grad_sync.chunk_syncs(models)
    if chunks is None:
        return
    config = models[0].config  # get_model_config(model[0]): the one the schedules read
    assert config.no_sync_func is None, "a model chunk's config already has a no_sync_func"
    config.no_sync_func = [c.no_sync for c in chunks]
    config.grad_sync_func = [c.start_grad_sync for c in chunks]
    if len(chunks) == 1:
        config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]


def resolved_schedule(args) -> str:
    """--pipeline-schedule, or Megatron-LM's choice when it is not given. Resolved once, by validation
    (arguments.py), which stores it in ``args.pipeline_schedule``: everything after reads that."""
    if args.pipeline_schedule is not None:
        return args.pipeline_schedule
    text, pp = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    more_stages = text is not None and len(layouts.parse(text).stages) > pp
    chunks = args.num_layers_per_virtual_pipeline_stage or (args.num_virtual_stages_per_pipeline_rank or 0) > 1
    return "megatron-interleaved" if chunks or more_stages else "megatron-1f1b"


def given_options(args) -> dict:
    """The schedule options the trainer takes as they are, by ScheduleSpec field; None if not given."""
    return {field: getattr(args, flag_dest(OPTION[field].trainer)) for field in SHARED}


def interleaved_chunks(args) -> int | None:
    """Model chunks per rank that --num-layers-per-virtual-pipeline-stage (or, with uneven first and last
    stages, --num-virtual-stages-per-pipeline-rank) gives, if set; under the interleaved schedules, a
    --pipeline-model-parallel-layout's stages over PP (Megatron-LM's rule)."""
    text, pp = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    if text is not None and args.pipeline_schedule in INTERLEAVED:
        return max(1, len(layouts.parse(text).stages) // pp)
    if args.num_virtual_stages_per_pipeline_rank:  # kept only with first/last counts (arguments.py)
        return args.num_virtual_stages_per_pipeline_rank
    v = args.num_layers_per_virtual_pipeline_stage
    return args.num_layers // (args.pipeline_model_parallel_size * v) if v else None


def schedule_request(args) -> ScheduleSpec | None:
    """The request our executor's schedule is built from, as the flags give it (the registry checks it
    and fills in its defaults); None for megatron-core's schedules and for a single stage."""
    name = args.pipeline_schedule
    if name not in REGISTRY or args.pipeline_model_parallel_size == 1:
        return None
    options = given_options(args)
    if args.overlap_moe_expert_parallel_comm and not halves_fit(args):
        options["halves"] = False  # pairs only (docs/moe.md): a micro-batch that does not split exactly
    spec = ScheduleSpec(name, args.pipeline_model_parallel_size, args.num_microbatches,
                        virtual_stages=interleaved_chunks(args) if "virtual_stages" in REGISTRY[name].options else None,
                        overlap=args.overlap_moe_expert_parallel_comm or None, **options)
    return spec


def halves_fit(args) -> bool:
    """Whether the micro-batches the schedule runs split into two halves along the batch, exactly: an
    even size (--micro-batch-size, halved again under --chimera-concat halving), and router statistics
    that two halves reproduce (``whole_batch_statistics``)."""
    size = args.micro_batch_size // (2 if args.chimera_concat == "halving" else 1)
    return size >= 2 and size % 2 == 0 and not whole_batch_statistics(args)


def whole_batch_statistics(args) -> list[str]:
    """The flags whose router statistics are computed from a whole micro-batch's tokens together, which
    two halves cannot reproduce: --moe-router-load-balancing-type aux_loss or global_aux_loss (with a
    coefficient) and sinkhorn (which routes each token by all the others), and
    --moe-expert-capacity-factor (a capacity of the whole micro-batch's). Means over tokens or sequences
    (z-loss, seq_aux_loss) and token counts (expert bias) are the whole's from its halves
    (model/schedule_plan.py)."""
    kinds = args.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    coeffs = args.moe_aux_loss_coeff
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(kinds)
    whole = [f"--moe-router-load-balancing-type {kind}" for kind, coeff in zip(kinds, coeffs)
             if kind == "sinkhorn" or kind in ("aux_loss", "global_aux_loss") and coeff]
    return whole + (["--moe-expert-capacity-factor"] if args.moe_expert_capacity_factor is not None else [])


def model_stages(args, request: ScheduleSpec | None) -> int:
    """Model stages per pipeline: PP times the stages per worker and pipeline that the registry gives
    the schedule (megatron-core's interleaved one: its chunks per rank). Known before the request is
    checked, so a --num-layers that does not divide is named first."""
    pp = args.pipeline_model_parallel_size
    if request is not None:
        return pp * REGISTRY[request.schedule].virtual_stages(request)
    return pp * (interleaved_chunks(args) or 1) if args.pipeline_schedule == "megatron-interleaved" else pp


def stage_layout(args, stages: int) -> Layout:
    """The layers each of the ``stages`` model stages holds, as Megatron-LM's five layout flags ask
    (checked: ConfigError naming the flag). Under the interleaved schedules the first and last layer
    counts are a pipeline rank's, spread over its chunks, as in megatron-core."""
    per_rank = stages // args.pipeline_model_parallel_size if args.pipeline_schedule in INTERLEAVED else 1
    return layouts.from_flags(args.num_layers, stages, args.mtp_num_layers or 0, args.pipeline_model_parallel_layout,
                              args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                              args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split,
                              per_rank)


def make_run_plan(args) -> RunPlan:
    """The plan for flags ``parse_args`` accepted: generates the schedule (once per process)."""
    request = schedule_request(args)
    stages = model_stages(args, request)
    held = stage_layout(args, stages)
    name, balanced_for = args.pipeline_schedule, args.balance_pipeline_layout
    if request is None:
        pp = args.pipeline_model_parallel_size
        virtual = stages // pp if name == "megatron-interleaved" else None
        return RunPlan(None, (tuple(s % pp for s in range(stages)),), stages, args.num_microbatches, 1.0, False,
                       virtual, held, name, balanced_for=balanced_for)
    schedule = generated(request)
    lowered, seconds = _proven(lower(schedule, **wider_reductions(args, held)))
    return RunPlan(schedule, schedule.placement, stages, schedule.microbatches, schedule.microbatch_scale,
                   schedule.split_backward, None, held, name, lowered, seconds, bool(request.overlap), balanced_for)


def wider_reductions(args, layout: Layout) -> dict:
    """What the lowered lists post beside the stage copies' reductions (``lower``'s options): with
    --overlap-grad-reduce, each stage's routed experts' where they have groups of their own, and the tied
    word embedding's, so that they start as early as the stage copies' and the checker proves them;
    without it nothing runs before the flush."""
    if not args.overlap_grad_reduce:
        return {}
    tied = layout.embedding_stages(not args.untie_embeddings_and_output_weights)
    return {"experts": ParallelDims.from_args(args).expert_groups, "embedding_stages": tied}


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


def flag_dest(flag: str) -> str:
    """The namespace attribute argparse stores ``flag`` in."""
    return flag.lstrip("-").replace("-", "_")
