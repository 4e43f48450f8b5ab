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
"""
from __future__ import annotations

from .chimera import mb_pipelines, placement
from .errors import require
from .ir import Action, Op, Schedule, with_grad_sync


def check(stages: int, microbatches: int) -> None:
    require(stages >= 2 and stages % 2 == 0, "stages", stages, "DualPipe needs an even number of stages (at least 2)")
    require(microbatches % 2 == 0 and microbatches >= 2 * stages, "microbatches", microbatches,
            f"DualPipe needs an even number of at least 2 x $stages ({2 * stages})")


def _slots(stages: int, microbatches: int, worker: int) -> list[tuple[str, str]]:
    """The worker's (op, E|L) slots; W slots name no pipeline."""
    half, h, m = stages // 2, min(worker, stages - 1 - worker), microbatches // 2
    rest = half - h - 1
    step6 = [("B", "L"), ("B", "E")] * (h + 1)
    step6 = step6[:h + 1] + [("I", which) for _, which in step6[h + 1:]]
    return ([("F", "E")] * (2 * rest) + [("F", "E"), ("F", "L")] * (h + 1)
            + [("I", "L"), ("W", ""), ("F", "L")] * rest
            + [("F", "E"), ("B", "L"), ("F", "L"), ("B", "E")] * (m - stages + h + 1)
            + [("B", "L"), ("F", "L"), ("B", "E")] * rest
            + step6 + [("W", ""), ("I", "E")] * rest + [("W", "")] * (h + 1))


def _resolve(stages: int, microbatches: int, worker: int, place) -> list[Action]:
    early = 0 if worker < stages // 2 else 1
    pipe = {"E": early, "L": 1 - early}
    stage = {p: place[p].index(worker) for p in (0, 1)}
    mbs = {p: [mb for mb, q in enumerate(mb_pipelines(microbatches, 2)) if q == p] for p in (0, 1)}
    taken = {("F", p): 0 for p in (0, 1)} | {("B", p): 0 for p in (0, 1)}
    waiting: list[Action] = []  # I passes whose W has not run, oldest first
    out = []
    for op, which in _slots(stages, microbatches, worker):
        if op == "W":
            i = waiting.pop(0)
            out.append(Action(Op.BACKWARD_WEIGHT, i.mb, i.pipeline, i.stage))
            continue
        p = pipe[which]
        counter = ("F", p) if op == "F" else ("B", p)
        mb = mbs[p][taken[counter]]
        taken[counter] += 1
        a = Action(Op(op), mb, p, stage[p])
        out.append(a)
        if a.op is Op.BACKWARD_INPUT:
            waiting.append(a)
    return out


def dualpipe(stages: int, microbatches: int) -> Schedule:
    check(stages, microbatches)
    place = placement(stages, 2)
    orders = tuple(tuple(_resolve(stages, microbatches, w, place)) for w in range(stages))
    return with_grad_sync(Schedule("dualpipe", stages, microbatches, place, orders, meta={"split_backward": True}))
