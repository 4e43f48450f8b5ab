"""Which layers each model stage holds in a case: the even split, Megatron-LM's best hand option and the
balancer's, each found for the schedule the case runs and priced at the benchmark's own costs.

A case's layout is one of three kinds. ``even``: Megatron-LM's default (``planner.even_layout``; where
the layers do not divide, the first stages take one more). ``megatron``: the best of the splits that
Megatron-LM's hand flags can ask for (``balancer.best_megatron``), with those flags. ``balanced``: the
balancer's search (``balancer.balance``). Both searches score a layout by simulating the case's own
order at the costs its emulated stages will wait (``Setup.costs``), so a measured difference between
kinds is the search's and the executor's, not a cost model's. The emulated device holds no model, so
layouts are chosen by time alone (the profile's memory is lifted); each keeps the planner's memory of
its largest worker, and whether that fits the profile's device.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from chimera_schedules import ConfigError, Schedule
from chimera_schedules.ir.layout import Layout
from chimera_schedules.tools import balancer
from chimera_schedules.tools.planner import even_layout

KINDS = ("even", "megatron", "balanced")


@dataclass(frozen=True)
class Chosen:
    kind: str  # one of KINDS
    layout: Layout
    flags: str = ""  # the Megatron-LM flags that ask for it (the megatron kind; "" for the default split)
    memory: float | None = None  # the planner's bytes on the largest worker; None where not priced (torch's)
    fits: bool | None = None  # whether that fits in the profile's device memory


def even(setup, virtual_stages: int) -> Chosen:
    """The even split over ``virtual_stages`` model stages per rank, unpriced: what
    torch.distributed.pipelining's cases run (their orders exist only once their stages are built)."""
    return Chosen("even", even_layout(setup.shape, setup.depth * virtual_stages))


def choose(setup, schedule: Schedule, kinds, skipped: list[str], label: str) -> list[Chosen]:
    """The layout of each kind for ``schedule`` at ``setup``'s costs; a kind that the model's layers
    rule out is left out and said in ``skipped`` under ``label``."""
    v, shape = schedule.virtual_stages, setup.shape
    free = dataclasses.replace(setup.profile, memory=math.inf)  # time alone: see the module

    rank_stages = balancer.per_rank(schedule)

    def priced(held: Layout):
        return setup.costs(v, held)
    search = {"even": lambda: balancer.score(shape, free, schedule, even_layout(shape, schedule.stages_per_pipeline),
                                             priced=priced),
              "megatron": lambda: balancer.best_megatron(shape, free, schedule, per_rank=rank_stages, priced=priced),
              "balanced": lambda: balancer.balance(shape, free, schedule, per_rank=rank_stages, priced=priced)}
    out = []
    for kind in kinds:
        try:
            found = search[kind]()
        except ConfigError as e:
            skipped.append(f"{label} {kind} layout: {e}")
            continue
        out.append(Chosen(kind, found.layout, found.flags, found.memory, found.memory <= setup.profile.memory))
    return out
