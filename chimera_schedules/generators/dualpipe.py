"""DualPipe (DeepSeek-V3, 2024) on the same IR: Chimera's two-pipeline placement with its own order.

Worker r holds stage r of the down pipeline (0) and stage D-1-r of the up pipeline (1), as Chimera.
Each pipeline gets N/2 micro-batches (contiguous blocks, as Chimera). With H = D/2, h = min(r, D-1-r),
M = N/2, E the pipeline in which the worker is early (position h) and L the one in which it is late,
worker r runs the eight steps of DualPipe's published ``step``:

1. 2 (H-h-1) x F_E
2. (h+1) x (F_E, F_L)
3. (H-h-1) x (I_L, W, F_L)
4. (M-D+h+1) x (F_E, B_L, F_L, B_E)
5. (H-h-1) x (B_L, F_L, B_E)
6. (h+1) x (B_L, B_E): the first h+1 of these backwards whole, the last h+1 split (I)
7. (H-h-1) x (W, I_E)
8. (h+1) x W

Forwards and backwards take each pipeline's micro-batches in FIFO order; each W completes the oldest
I whose W has not run (DualPipe's weight-gradient queue). DualPipe overlaps a forward of one pipeline
with a backward of the other in one kernel stream (MoE communication overlap); without that
overlap, the pair runs forward first, as DualPipe itself does when no overlap is given.

DualPipeV (``dualpipev``) folds one pipeline of 2D model stages into a V over D workers: worker r
holds stage r (the way out, E) and stage 2D-1-r (the way back, L), so the last worker hands its
activation to itself and the first worker holds the embedding and the loss. Every micro-batch runs
both ways; the eight steps are the same with H = D, h = r and M = N (N >= 2D). The IR says this as one
pipeline of 2 chunks per worker with a V-shaped placement, so nothing else needs to know about it.
"""
from __future__ import annotations

from ..ir.actions import Action, Op
from ..ir.errors import require
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync
from .placement import mb_pipelines, placement


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
    place = (tuple(range(depth)) + tuple(reversed(range(depth))),)
    every = list(range(microbatches))
    orders = tuple(tuple(_resolve(_slots(depth, w, microbatches), {"E": (0, w), "L": (0, 2 * depth - 1 - w)},
                                  {"E": every, "L": every})) for w in range(depth))
    return with_grad_sync(Schedule("dualpipev", depth, microbatches, place, orders, virtual_stages=2))
