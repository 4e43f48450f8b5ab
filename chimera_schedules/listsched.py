"""Greedy list scheduling: build per-worker orders by simulating the pipeline and, whenever a worker
is free, starting the ready action it ranks first.

It serves two generators: Chimera with more than two pipelines (no closed-form order) and
``--order best`` (a memory-capped search for a shorter iteration than direct concatenation).
The resulting orders are ordinary schedules: the simulator replays them to the same or an
earlier makespan, and the validator checks them like any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .ir import Action, B, F, Schedule
from .simulator import CostModel, activation_units


@dataclass(frozen=True)
class Shape:
    """What a list schedule needs to know about the pipelines: placement and each micro-batch's
    pipeline (micro-batches of one pipeline enter stage 0 in increasing order)."""

    stages: int
    microbatches: int
    placement: tuple[tuple[int, ...], ...]
    mb_pipeline: tuple[int, ...]
    chunks: int = 1
    microbatch_scale: float = 1.0

    def empty(self, name: str) -> Schedule:
        return Schedule(name, self.stages, self.microbatches, self.placement,
                        tuple(() for _ in range(self.stages)), self.chunks, self.microbatch_scale)


# A rule ranks a candidate, smaller first: (action, time its inputs arrived) -> key.
Rule = Callable[[Action, float], tuple]


def deepest_first(a: Action, ready: float) -> tuple:
    """Backward first (frees memory), then the deepest stage (closest to the loss, so the other
    direction's work is unblocked soonest), then the oldest micro-batch. With 1F1B's per-stage cap
    this reproduces the paper's optimal two-pipeline makespans (16 at D=4, 36 at D=8 with B = 2F)
    and gives D/f - 2 bubbles per worker for 2f pipelines at unit costs."""
    return (a.op.value != "B", -a.stage, a.mb)


def list_schedule(shape: Shape, costs: CostModel, rule: Rule = deepest_first,
                  cap: float | None = None) -> list[list[Action]] | None:
    """Per-worker orders from a non-delay greedy simulation; None if the memory cap starves it.

    Each (pipeline, stage) keeps 1F1B's discipline: at most (stages - stage) of its micro-batches
    alive. ``cap`` bounds a worker's total live activations (in M_a units)."""
    probe = shape.empty("list")
    last = shape.stages * shape.chunks - 1
    transfer = costs.transfer_time(probe)
    per_pipeline: dict[int, list[int]] = {}
    for m, p in enumerate(shape.mb_pipeline):
        per_pipeline.setdefault(p, []).append(m)
    next_input = {p: 0 for p in per_pipeline}  # index of the next micro-batch entering stage 0
    # ready[w]: candidate action -> time its inputs are on worker w
    ready: list[dict[Action, float]] = [dict() for _ in range(shape.stages)]
    free = [0.0] * shape.stages
    live = [0.0] * shape.stages
    stage_live: dict[tuple[int, int], int] = {}
    orders: list[list[Action]] = [[] for _ in range(shape.stages)]
    running: list[tuple[float, int, Action]] = []  # (end, worker, action)
    remaining = 2 * shape.microbatches * (last + 1)
    now = 0.0

    def offer(action: Action, at: float) -> None:
        w = shape.placement[action.pipeline][action.stage]
        ready[w][action] = at

    def offer_next_input(p: int) -> None:
        if next_input[p] < len(per_pipeline[p]):
            offer(F(per_pipeline[p][next_input[p]], p, 0), 0.0)

    for p in per_pipeline:
        offer_next_input(p)
    while remaining:
        for w in range(shape.stages):
            if free[w] > now:
                continue
            options = [(a, t) for a, t in ready[w].items() if t <= now and (a.op.value == "B" or (
                stage_live.get((a.pipeline, a.stage), 0) < shape.stages - a.stage // shape.chunks and
                (cap is None or live[w] + activation_units(probe, a) <= cap + 1e-9)))]
            if not options:
                continue
            a, _ = min(options, key=lambda o: rule(o[0], o[1]))
            del ready[w][a]
            end = now + costs.compute_time(probe, a)
            free[w] = end
            orders[w].append(a)
            sign = 1 if a.op.value == "F" else -1
            live[w] += activation_units(probe, a) * sign
            stage_live[(a.pipeline, a.stage)] = stage_live.get((a.pipeline, a.stage), 0) + sign
            running.append((end, w, a))
            if a.op.value == "F" and a.stage == 0:
                next_input[a.pipeline] += 1
                offer_next_input(a.pipeline)
        upcoming = [end for end, _, _ in running] + [t for r in ready for t in r.values() if t > now]
        if not upcoming:
            return None  # nothing runs and nothing arrives: the cap starves the pipeline
        now = min(upcoming)
        finished = [r for r in running if r[0] <= now]
        running = [r for r in running if r[0] > now]
        for end, w, a in finished:
            remaining -= 1
            p, s, m = a.pipeline, a.stage, a.mb
            if a.op.value == "F":
                if s < last:
                    nxt = F(m, p, s + 1)
                    offer(nxt, end + (transfer if shape.placement[p][s + 1] != w else 0.0))
                else:
                    offer(B(m, p, s), end)
            elif s > 0:
                prev = B(m, p, s - 1)
                offer(prev, end + (transfer if shape.placement[p][s - 1] != w else 0.0))
    return orders
