"""Hanayo's wave-like pipeline (Liu et al., "Hanayo: Harnessing Wave-like Pipeline Parallelism for Enhanced
Large Model Training Efficiency", SC'23) on the same IR.

One pipeline, one copy of the weights: the model is cut into 2 x waves x D model stages that cross the D
workers as waves, down over workers 0..D-1, back up over D-1..0, then down again, so each worker holds
2 x waves chunks and the hand-offs at the turning points stay on one worker. Micro-batches all take the
same path.

The order: the paper's text was not available to us (no public code either), so the order is a greedy
list schedule on the wave placement (``listsched.py``): a free worker runs the ready pass of its oldest
micro-batch, a backward before a forward, under 1F1B's activation memory (D micro-batches' worth on a
worker) where that does not starve the pipeline, else without a cap. docs/schedules.md ("Chimera beside its
successors") says what this departs from and what it reaches.
"""
from __future__ import annotations

from ..ir.actions import Action, Op
from ..ir.costs import CostModel
from ..ir.errors import require
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync
from .listsched import Greed, Shape, list_schedule


def check(depth: int, microbatches: int, waves: int) -> None:
    require(depth >= 2, "depth", depth, "Hanayo's waves need at least 2 stages")
    require(waves >= 1, "waves", waves, "must be at least 1")
    require(microbatches >= 1, "microbatches", microbatches, "must be at least 1")


def wave_placement(depth: int, waves: int) -> tuple[tuple[int, ...], ...]:
    """Model stage s on worker s mod 2D going down, 2D-1 - (s mod 2D) coming back up."""
    def worker(s: int) -> int:
        p = s % (2 * depth)
        return p if p < depth else 2 * depth - 1 - p
    return (tuple(worker(s) for s in range(2 * waves * depth)),)


def oldest_first(a: Action, ready: float) -> tuple:
    """The oldest micro-batch's pass first (1F1B's discipline across the waves); a backward before a
    forward of the same micro-batch; then the deepest stage."""
    return (a.mb, a.op is not Op.BACKWARD, -a.stage)


def hanayo(depth: int, microbatches: int, waves: int, costs: CostModel) -> Schedule:
    check(depth, microbatches, waves)
    shape = Shape(depth, microbatches, wave_placement(depth, waves), (0,) * microbatches, virtual_stages=2 * waves)
    orders = list_schedule(shape, costs, oldest_first, cap=float(depth), greed=Greed(stage_limit=False))
    if orders is None:  # 1F1B's memory starves this N: the order without a cap
        orders = list_schedule(shape, costs, oldest_first, greed=Greed(stage_limit=False))
    return with_grad_sync(Schedule("hanayo", depth, microbatches, shape.placement, tuple(map(tuple, orders)),
                                   virtual_stages=2 * waves))
