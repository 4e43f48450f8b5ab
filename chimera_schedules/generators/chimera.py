"""Chimera's bidirectional schedules (Li & Hoefler, SC'21).

Placement and the micro-batches' pipelines: ``placement.py``.

``chimera(D, N, pipelines, concat)`` builds the paper's order for two pipelines (``paper_pattern``:
the "basic unit" of N = D micro-batches, each pipeline's micro-batches in FIFO order) and, for
N = K D, K units concatenated ``direct`` (back to back, each unit's leading forwards interleaved with
the previous unit's trailing backwards), ``doubling`` (two micro-batches per forward slot; K even) or
``halving`` (doubling over 2N micro-batches of half the size). More than two pipelines are
list-scheduled under the given costs. The basic unit's formula, each concatenation's bubbles and
memory, and the list scheduler's rule: docs/notes/chimera-orders.md.
"""
from __future__ import annotations

from ..ir.actions import Action, B, F
from ..ir.costs import CostModel
from ..ir.errors import require
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync
from .listsched import Shape, list_schedule
from .placement import mb_pipelines, placement


def check(depth: int, microbatches: int, pipelines: int = 2, concat: str = "direct") -> None:
    """Every rule a Chimera request must meet, each naming its option."""
    require(depth >= 2 and depth % 2 == 0, "depth", depth,
            "Chimera needs an even number of stages (at least 2)")
    require(pipelines >= 2 and pipelines % 2 == 0, "pipelines", pipelines,
            "Chimera needs an even number of pipelines (down and up in pairs)")
    require((depth // 2) % (pipelines // 2) == 0, "pipelines", pipelines,
            f"P/2 must divide D/2 = {depth // 2}")
    require(microbatches >= depth and microbatches % depth == 0, "microbatches", microbatches,
            f"Chimera needs a multiple of $depth ({depth}): N = K x D")
    if concat == "doubling":
        require((microbatches // depth) % 2 == 0, "microbatches", microbatches,
                f"forward doubling pairs basic units: needs a multiple of 2 x D = {2 * depth}")
    if pipelines > 2:
        require(concat == "direct", "concat", concat,
                "more than two pipelines support direct concatenation only")


def paper_pattern(depth: int, worker: int, units: int, doubled: bool) -> list[tuple[str, str]]:
    """The worker's sequence of (F|B, X|Y) slots for ``units`` basic units (pairs of units when
    ``doubled``), concatenated as the reference code does."""
    s = min(worker, depth - 1 - worker)
    a, b = depth // 2 - s, s
    fx = [("F", "X")] * (2 if doubled else 1)
    fy = [("F", "Y")] * (2 if doubled else 1)
    pairs = len(fx) * (a + b) - a
    slots: list[tuple[str, str]] = []
    for u in range(units):
        for _ in range(a):
            slots += ([] if u == 0 else [("B", "X")]) + fx
        for _ in range(b):
            slots += fy + fx
        for _ in range(a):
            slots += fy + [("B", "Y")]
        slots += [("B", "X"), ("B", "Y")] * pairs
    return slots + [("B", "X")] * a


def _resolve(depth: int, microbatches: int, place, worker: int, slots) -> list[Action]:
    """Turn X/Y slots into actions: each pipeline's forwards and backwards take its micro-batches in
    FIFO order."""
    x = 0 if worker < depth // 2 else 1
    pipe = {"X": x, "Y": 1 - x}
    stage = {p: place[p].index(worker) for p in (0, 1)}
    mbs = {p: [m for m, q in enumerate(mb_pipelines(microbatches, 2)) if q == p] for p in (0, 1)}
    nxt = {(k, p): 0 for k in "FB" for p in (0, 1)}
    out = []
    for kind, which in slots:
        p = pipe[which]
        m = mbs[p][nxt[(kind, p)]]
        nxt[(kind, p)] += 1
        out.append((F if kind == "F" else B)(m, p, stage[p]))
    return out


def chimera(depth: int, microbatches: int, pipelines: int = 2, concat: str = "direct",
            costs: CostModel | None = None) -> Schedule:
    """Chimera in the paper's order (or list-scheduled for more than two pipelines)."""
    check(depth, microbatches, pipelines, concat)
    name = f"chimera-{concat}" if pipelines == 2 else f"chimera-{pipelines}p"
    scale = 1.0
    if concat == "halving":
        microbatches, scale = 2 * microbatches, 0.5
    place = placement(depth, pipelines)
    if pipelines == 2:
        units = microbatches // depth
        doubled = concat != "direct"
        orders = [_resolve(depth, microbatches, place, w,
                           paper_pattern(depth, w, units // 2 if doubled else units, doubled))
                  for w in range(depth)]
    else:
        shape = Shape(depth, microbatches, place, mb_pipelines(microbatches, pipelines))
        orders = list_schedule(shape, costs or CostModel())
    return with_grad_sync(Schedule(name, depth, microbatches, place, tuple(map(tuple, orders)),
                                   microbatch_scale=scale, meta={"concat": concat, "order": "paper"}))
