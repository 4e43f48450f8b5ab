"""DualPipe (DeepSeek-V3, 2024) on the same IR: Chimera's two-pipeline placement with its own order.

``dualpipe(D, N)``: worker r holds stage r of the down pipeline (0) and stage D-1-r of the up pipeline
(1), as Chimera, each pipeline N/2 micro-batches, and runs the eight steps of DualPipe's published
``step``, with a split backward (I, then W from DualPipe's weight-gradient queue) where DualPipe has
one. ``dualpipev(D, N)`` folds one pipeline of 2D model stages into a V over D workers (N >= 2D): one
pipeline of 2 chunks per worker with a V-shaped placement, so nothing else needs to know about it.
Without MoE communication overlap, a forward and backward that DualPipe pairs run forward first.
The eight steps, and how DualPipeV reuses them: docs/notes/dualpipe-order.md.
"""
from __future__ import annotations

from ..ir.actions import Action, Op
from ..ir.errors import require
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync
from .placement import mb_pipelines, placement, v_placement


def check(depth: int, microbatches: int) -> None:
    require(depth >= 2 and depth % 2 == 0, "depth", depth, "DualPipe needs an even number of stages (at least 2)")
    require(microbatches % 2 == 0 and microbatches >= 2 * depth, "microbatches", microbatches,
            f"DualPipe needs an even number of at least 2 x $depth ({2 * depth})")


def check_v(depth: int, microbatches: int) -> None:
    require(depth >= 1, "depth", depth, "must be at least 1")
    require(microbatches >= 2 * depth, "microbatches", microbatches,
            f"DualPipeV needs at least 2 x $depth ({2 * depth})")


def _slots(half: int, h: int, m: int) -> list[tuple[str, str]]:
    """A worker's (op, E|L) slots in the eight steps; W slots name no stage."""
    rest = half - h - 1
    step6 = [("B", "L"), ("B", "E")] * (h + 1)
    step6 = step6[:h + 1] + [("I", which) for _, which in step6[h + 1:]]
    return ([("F", "E")] * (2 * rest) + [("F", "E"), ("F", "L")] * (h + 1)
            + [("I", "L"), ("W", ""), ("F", "L")] * rest
            + [("F", "E"), ("B", "L"), ("F", "L"), ("B", "E")] * (m - 2 * half + h + 1)
            + [("B", "L"), ("F", "L"), ("B", "E")] * rest
            + step6 + [("W", ""), ("I", "E")] * rest + [("W", "")] * (h + 1))


def _resolve(slots, where: dict, mbs: dict) -> list[Action]:
    """Slots to actions. ``where[E|L]`` = (pipeline, stage), ``mbs[E|L]`` its micro-batches in order;
    forwards and backwards take them FIFO, and each W completes the oldest I still waiting."""
    taken = {(op, which): 0 for op in "FB" for which in "EL"}
    waiting: list[Action] = []
    out = []
    for op, which in slots:
        if op == "W":
            i = waiting.pop(0)
            out.append(Action(Op.BACKWARD_WEIGHT, i.mb, i.pipeline, i.stage))
            continue
        counter = ("F" if op == "F" else "B", which)
        mb = mbs[which][taken[counter]]
        taken[counter] += 1
        a = Action(Op(op), mb, *where[which])
        out.append(a)
        if a.op is Op.BACKWARD_INPUT:
            waiting.append(a)
    return out


def dualpipe(depth: int, microbatches: int) -> Schedule:
    check(depth, microbatches)
    place = placement(depth, 2)
    mbs = {p: [mb for mb, q in enumerate(mb_pipelines(microbatches, 2)) if q == p] for p in (0, 1)}
    orders = []
    for w in range(depth):
        early = 0 if w < depth // 2 else 1
        pipe = {"E": early, "L": 1 - early}
        where = {k: (p, place[p].index(w)) for k, p in pipe.items()}
        slots = _slots(depth // 2, min(w, depth - 1 - w), microbatches // 2)
        orders.append(tuple(_resolve(slots, where, {k: mbs[p] for k, p in pipe.items()})))
    return with_grad_sync(Schedule("dualpipe", depth, microbatches, place, tuple(orders)))


def dualpipev(depth: int, microbatches: int) -> Schedule:
    """``depth`` workers, 2 x ``depth`` model stages in a V."""
    check_v(depth, microbatches)
    place = v_placement(depth)
    every = list(range(microbatches))
    orders = tuple(tuple(_resolve(_slots(depth, w, microbatches), {"E": (0, w), "L": (0, 2 * depth - 1 - w)},
                                  {"E": every, "L": every})) for w in range(depth))
    return with_grad_sync(Schedule("dualpipev", depth, microbatches, place, orders, virtual_stages=2))
