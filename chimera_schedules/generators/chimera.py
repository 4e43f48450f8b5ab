"""Chimera's bidirectional schedules (Li & Hoefler, SC'21).

Placement and the micro-batches' pipelines: ``placement.py``.

Paper order (two pipelines, N = D, the "basic unit"): a worker whose early stage is s < D/2 holds it
in pipeline X and its late stage in pipeline Y; with a = D/2 - s, b = s it runs
    a x F_X; b x (F_Y, F_X); a x (F_Y, B_Y); b x (B_X, B_Y); a x B_X
with each pipeline's micro-batches in FIFO order.

N = K D micro-batches:
- direct: K units back to back; from the second unit on, the unit's leading a forwards of X are
  interleaved with the previous unit's trailing a backwards of X: a x (B_X, F_X).
- doubling: units in pairs; every forward slot runs two micro-batches of its pipeline, and a pair of
  units has 2(a+b) - a = a + 2b (B_X, B_Y) slots. With B = 2F a doubled forward slot lasts as long as a
  backward, so the bubble ratio stays (D-2)/(2N+D-2). Activations double. Needs K even.
- halving (this project's definition; the paper names it, the reference does not implement it):
  forward doubling over 2N micro-batches of half the size. A forward slot then runs two halves (one
  user micro-batch: the basic unit's activation memory), and a backward slot one half (about one
  forward's time), so slots balance without doubling activations; the price is smaller GEMMs.
  ``microbatch_scale`` = 0.5 tells the simulator and the executor. Works for any K.

More than two pipelines have no closed-form order here: they are list-scheduled under the given
costs (backward first, then the deepest stage, each stage at most 1F1B's D - s micro-batches alive),
which gives D/f - 2 bubbles per worker at unit costs for N = D.
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
