"""The plans ``--pipeline-schedule auto`` chooses among, ranked: one call for the trainer
(megatron/chimera/config/auto_plan.py, which turns the pick into flags and checks them against its own rules),
``python -m megatron.chimera.plan`` (the same, offline) and the depth benchmark's ``auto`` row.

A request fixes the model, the hardware profile, the pipeline depth, the data-parallel width, the global
batch, the micro-batch sizes allowed and the memory limit. The candidates: every planned variant of the
registry (``planner.PLANNED``), DualPipeV, Chimera's successors (``SUCCESSORS``), interleaved v=2 where the
layers split over 2D stages, and the
F&B-overlapped variants where experts run over an expert-parallel group with the all-to-all dispatcher,
at each micro-batch size that divides the batch. Each is predicted by the simulator at the request's
stage costs (``priced``; the FLOP count at the profile's rate without it), its memory by the planner;
the fastest plans that fit are tried again under the balancer's layout (tools/balancer.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..analysis.simulator import simulate
from ..ir import layout
from ..ir.costs import CostModel
from ..ir.errors import require
from ..registry import build_spec, variant
from .balancer import Pricing, Sizes, balance, per_rank
from .planner import (
    PLANNED,
    Candidate,
    ModelShape,
    Precision,
    Profile,
    StageCosts,
    costs,
    even_layout,
    plan,
    virtual_stages,
)

OVERLAPPED = ("1f1b overlap", "chimera direct overlap", "chimera split overlap", "dualpipe overlap",
              "dualpipev overlap", "v-zb overlap", "bitpipe overlap")
# Chimera's successors (docs/schedules.md): the V schedules at a half, a third and all of 1F1B's activations,
# Hanayo's waves and BitPipe
SUCCESSORS = ("v-min", "v-half", "v-zb", "hanayo", "bitpipe", "bitpipe split")
BALANCED = 1  # the fastest plans that fit, tried again under the balancer's layout (about 30 s each at D=16)


@dataclass(frozen=True)
class Request:
    """What one run fixes; the planner chooses the rest."""
    shape: ModelShape
    profile: Profile
    depth: int
    width: int
    global_batch: int
    micro_batches: tuple[int, ...]
    limit: float  # bytes per worker
    precision: Precision = Precision()
    expert_parallel: int = 1
    context_parallel: int = 1
    overlap: bool = False  # experts over EP > 1 with the all-to-all dispatcher: the overlapped variants apply
    balance: bool = True  # try the balancer's layout (False: the user gave theirs, or one stage)
    priced: StageCosts | None = None


@dataclass
class Balanced(Candidate):
    """A candidate under the balancer's layout instead of the even split."""
    layout: str = ""

    @property
    def label(self) -> str:
        return super().label + " balanced"


def schedules(request: Request) -> tuple[str, ...]:
    """The variants the request allows."""
    d = request.depth
    out = list(PLANNED) + ["dualpipev", *SUCCESSORS]
    out += ["interleaved v=2"] if d > 1 and request.shape.layers % (2 * d) == 0 else []
    return tuple(out + (list(OVERLAPPED) if request.overlap else []))


def ranked(request: Request) -> list[Candidate]:
    """Every candidate the request allows, fastest predicted first (fitting or not: ``fits_in`` says)."""
    found = plan(request.depth * request.width, request.global_batch, request.shape, request.profile,
                 depths=[request.depth], micro_batches=request.micro_batches, precision=request.precision,
                 schedules=schedules(request), expert_parallel=(request.expert_parallel,), priced=request.priced)
    require(found, "--pipeline-schedule", "auto", f"no planned schedule takes PP={request.depth} with "
            f"{request.global_batch} samples per batch over DP={request.width}")
    found = sorted(found, key=lambda c: c.seconds)
    if request.balance and request.depth > 1:
        fastest = [c for c in found if fits_in(c, request)][:BALANCED]
        found = sorted(found + _balanced(request, fastest), key=lambda c: c.seconds)
    return found


def fits_in(c: Candidate, request: Request) -> bool:
    return c.memory <= request.limit


def _balanced(request: Request, fastest: list[Candidate]) -> list[Balanced]:
    """The fastest candidates again under the balancer's layout, where it is predicted faster and fits."""
    out = []
    for c in fastest:
        v = virtual_stages(c.schedule, c.depth, c.microbatches)
        pricing = _pricing(request, c, v)
        schedule = build_spec(variant(c.schedule, c.depth, c.microbatches), pricing(even_layout(request.shape,
                                                                                              c.depth * v)))
        sizes = Sizes(c.micro_batch, c.width, c.expert_parallel, request.precision, request.context_parallel)
        picked = balance(request.shape, request.profile, schedule, sizes, per_rank(schedule), pricing)
        if picked.seconds < c.seconds and picked.memory <= request.limit:
            out.append(Balanced(**{**dataclasses.asdict(c), "seconds": picked.seconds, "memory": picked.memory,
                                   "bubble_ratio": simulate(schedule, pricing(picked.layout)).bubble_ratio},
                                layout=str(picked.layout)))
    return out


def stage_costs(request: Request, c: Candidate) -> CostModel:
    """The stage costs the candidate was predicted at (the trainer builds its order at their forward and
    backward times: --pipeline-stage-costs)."""
    v = virtual_stages(c.schedule, c.depth, c.microbatches)
    held = layout.parse(c.layout) if isinstance(c, Balanced) else even_layout(request.shape, c.depth * v)
    return _pricing(request, c, v)(held)


def _pricing(request: Request, c: Candidate, v: int) -> Pricing:
    """A layout's stage costs for the candidate: the request's own, or the FLOP count at the profile's rate."""
    if request.priced is not None:
        return lambda held: request.priced(v, held, c.micro_batch)
    return lambda held: costs(request.shape, request.profile, c.depth, c.micro_batch, c.width, c.expert_parallel,
                              v, held)
