"""The layout balancer: how many transformer layers each model stage should hold, for one schedule.

Real models are uneven along the pipeline: the embedding sits on the first model stage, the output
layer, the loss and multi-token prediction on the last, and under Chimera worker i holds both stage i
and stage D-1-i, so its two edge workers carry both ends. The best split therefore depends on the
schedule's placement, and no hand rule finds it for every schedule.

``balance`` searches the per-stage layer counts (the embedding on the first stage, MTP and the loss on
the last, as Megatron-LM places them) for the one whose simulated iteration time, at the planner's
per-stage costs (``planner.stage_forward``), is least among those that fit the profile's memory
(``planner.worker_memory``): a steepest descent over "move one layer from stage i to stage j", started
from the even split, Megatron-LM's best hand option and the split that equalises stage times.
``megatron_options`` lists those hand options (the account-for flags, the first and last stages'
layer counts) with the flags that ask for each.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..analysis.simulator import simulate
from ..ir import layout as layouts
from ..ir.costs import CostModel
from ..ir.errors import ConfigError
from ..ir.layout import Layout
from ..ir.schedule import Schedule
from .planner import ModelShape, Precision, Profile, costs, even_layout, stage_forward, worker_memory


@dataclass(frozen=True)
class Sizes:
    """What the costs depend on besides the model and the layout."""
    micro_batch: int = 1
    width: int = 1
    expert_parallel: int = 1
    precision: Precision = Precision()
    context_parallel: int = 1


# What a caller prices a layout at instead of the planner (the depth benchmark: its emulated stages' times)
Pricing = Callable[[Layout], CostModel]


@dataclass(frozen=True)
class Scored:
    layout: Layout
    seconds: float  # simulated iteration time; inf where it does not fit in memory
    memory: float  # the largest worker's bytes
    flags: str = ""  # the Megatron-LM flags that ask for it ("" for the even split and the balancer's)


def score(shape: ModelShape, profile: Profile, schedule: Schedule, held: Layout, sizes: Sizes = Sizes(),
          priced: Pricing | None = None) -> Scored:
    """The layout's simulated iteration time, at the planner's costs or at ``priced(layout)``'s."""
    d, v = schedule.num_workers, schedule.virtual_stages
    model = (priced(held) if priced else
             costs(shape, profile, d, sizes.micro_batch, sizes.width, sizes.expert_parallel, v, held))
    memory = worker_memory(shape, schedule, held, sizes.micro_batch, sizes.width, sizes.expert_parallel,
                           sizes.precision, sizes.context_parallel)
    seconds = simulate(schedule, model).makespan if memory <= profile.memory else math.inf
    return Scored(held, seconds, memory)


def per_rank(schedule: Schedule) -> int:
    """What Megatron-LM's first and last stage flags count over: under its round-robin placement
    (interleaved) a rank's v stages; under any other placement (Chimera's, a V) the model stage."""
    d = schedule.num_workers
    round_robin = all(w == s % d for row in schedule.placement for s, w in enumerate(row))
    return schedule.virtual_stages if round_robin else 1


def megatron_options(shape: ModelShape, stages: int, per_rank: int = 1) -> list[tuple[Layout, str]]:
    """Every split Megatron-LM's hand flags give this model: the even split (where the layers divide),
    the account-for flags, and each pair of first and last stage layer counts whose remainder the middle
    stages share evenly."""
    out, seen = [], set()

    def add(flags: str, **kwargs) -> None:
        try:
            held = layouts.megatron(shape.layers, stages, shape.mtp, per_rank=per_rank, **kwargs)
        except ConfigError:
            return
        if held not in seen:
            seen.add(held)
            out.append((held, flags))

    add("")
    add("--account-for-embedding-in-pipeline-split", account_embedding=True)
    add("--account-for-loss-in-pipeline-split", account_loss=True)
    add("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
        account_embedding=True, account_loss=True)
    for first in [None, *range(0, shape.layers + 1, per_rank)]:
        for last in [None, *range(0, shape.layers + 1, per_rank)]:
            if first is not None or last is not None:
                flags = " ".join(f"--decoder-{end}-pipeline-num-layers {n}"
                                 for end, n in (("first", first), ("last", last)) if n is not None)
                add(flags, first=first, last=last)
    return out


def best_megatron(shape: ModelShape, profile: Profile, schedule: Schedule, sizes: Sizes = Sizes(),
                  per_rank: int = 1, priced: Pricing | None = None) -> Scored:
    """Megatron-LM's best hand option for this schedule, found by trying each in the simulator."""
    tried = [Scored(s.layout, s.seconds, s.memory, flags) for held, flags in
             megatron_options(shape, schedule.stages_per_pipeline, per_rank)
             for s in [score(shape, profile, schedule, held, sizes, priced)]]
    if not tried:
        raise ConfigError("--num-layers", shape.layers, "no Megatron-LM split of it fits these stages")
    return min(tried, key=lambda s: (s.seconds, s.memory))


def equal_time(shape: ModelShape, profile: Profile, stages: int, sizes: Sizes = Sizes()) -> Layout:
    """The split whose stages take as nearly equal forward times as whole layers allow: layers go one
    at a time to the stage that is fastest with it."""
    counts = [0] * stages
    for _ in range(shape.layers):
        def time_with(s: int) -> float:
            trial = counts[:s] + [counts[s] + 1] + counts[s + 1:]
            held = layouts.from_counts(trial, shape.mtp)
            return stage_forward(shape, profile, held, s, sizes.micro_batch, sizes.expert_parallel)
        counts[min(range(stages), key=time_with)] += 1
    return layouts.from_counts(counts, shape.mtp)


def balance(shape: ModelShape, profile: Profile, schedule: Schedule, sizes: Sizes = Sizes(),
            per_rank: int = 1, priced: Pricing | None = None) -> Scored:
    """The layer counts with the least simulated iteration time that fit in memory (see the module)."""
    stages = schedule.stages_per_pipeline
    starts = [even_layout(shape, stages), equal_time(shape, profile, stages, sizes)]
    try:
        starts.append(best_megatron(shape, profile, schedule, sizes, per_rank, priced).layout)
    except ConfigError:
        pass
    best = min((score(shape, profile, schedule, held, sizes, priced) for held in starts), key=lambda s: s.seconds)
    while True:
        step = _best_move(shape, profile, schedule, sizes, priced, best)
        if step is None:
            return best
        best = step


def _best_move(shape, profile, schedule, sizes, priced, current: Scored) -> Scored | None:
    """The best layout one layer away from ``current`` (a layer moved between two stages), if faster."""
    counts = list(current.layout.layer_counts())
    best = current
    for i, n in enumerate(counts):
        if n == 0:
            continue
        for j in range(len(counts)):
            if j == i:
                continue
            trial = list(counts)
            trial[i] -= 1
            trial[j] += 1
            scored = score(shape, profile, schedule, layouts.from_counts(trial, shape.mtp), sizes, priced)
            if scored.seconds < best.seconds * (1 - 1e-9):
                best = scored
    return None if best is current else best
