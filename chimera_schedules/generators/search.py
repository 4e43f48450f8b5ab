"""``--order best``: a memory-capped Chimera order for N = K D micro-batches.

Direct concatenation leaves bubbles between basic units when B is about 2F; forward doubling removes
them at twice the activation memory. This finds an order that keeps every worker at most ``cap``
(D, the basic unit's budget) live micro-batches and gets as close as it can to the optimal
makespan under the given costs:

1. candidates: the paper's direct concatenation, and a capped list schedule;
2. a constraint model (OR-Tools CP-SAT): one interval per action, no overlap per worker, data
   dependencies with p2p delays, a cumulative live-activation cap per worker, each pipeline's
   micro-batches in FIFO order at every stage (the paper's convention, and a strong symmetry break),
   seeded with the best candidate and run single-threaded with a deterministic time budget, so every
   rank that builds the schedule builds the same one;
3. the best of all, by simulated makespan, so ``best`` is never worse than ``paper``.

With F = 1, B = 2 and no communication cost this reaches the proven optima 28 (D=4, N=8) and 52
(D=4, N=16), and 60 (D=8, N=16).

With ``split`` the backwards are I and W passes (zero_bubble.py): the candidate is the paper order
split, and the model gains a W interval per action after its I; a micro-batch is alive from its F to
the end of its W.
"""
from __future__ import annotations

import math

from ..analysis.simulator import peak_activations, simulate
from ..ir.actions import Action, Op
from ..ir.costs import CostModel
from ..ir.dataflow import dependencies, producer
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync
from ..passes.zero_bubble import split_backward
from .chimera import check, chimera
from .listsched import Shape, list_schedule
from .placement import mb_pipelines, placement


def best_order(depth: int, microbatches: int, costs: CostModel | None = None, pipelines: int = 2,
               effort: float = 5.0, split: bool = False) -> Schedule:
    """At most D live micro-batches per worker. ``effort`` is the solver's deterministic time budget
    (roughly three wall seconds per unit on a 2-core machine)."""
    check(depth, microbatches, pipelines, "direct")
    costs = costs or CostModel()
    cap = depth
    paper = chimera(depth, microbatches, pipelines, "direct", costs)
    shape = Shape(depth, microbatches, placement(depth, pipelines), mb_pipelines(microbatches, pipelines))
    candidates = [paper]
    listed = None if split else list_schedule(shape, costs, cap=cap)
    if listed is not None:
        candidates.append(_as_schedule(shape, listed))
    if split:
        candidates = [split_backward(paper, costs, [cap] * depth)]
    candidates = [c for c in candidates if max(peak_activations(c)) <= cap + 1e-9]
    seed = min(candidates, key=lambda c: simulate(c, costs).makespan)
    solved = _solve(shape, costs, cap, seed, effort, split)
    if solved is not None:
        candidates.append(solved)
    best = min(candidates, key=lambda c: simulate(c, costs).makespan)  # min keeps the first of equals
    name = "chimera-split-best" if split else "chimera-best"
    return Schedule(name, depth, microbatches, best.placement, best.workers,
                    meta={"concat": "direct", "order": "best", "cap": cap})


def _as_schedule(shape: Shape, orders: list[list[Action]]) -> Schedule:
    return with_grad_sync(Schedule("chimera-best", shape.depth, shape.microbatches, shape.placement,
                                   tuple(map(tuple, orders))))


def _solve(shape: Shape, costs: CostModel, cap: float, seed: Schedule, effort: float,
           split: bool) -> Schedule | None:
    from ortools.sat.python import cp_model  # here, not at the top: 2 s to import, for --order best only

    ops = "FIW" if split else "FB"
    model = _Model(cp_model.CpModel(), shape, costs, ops, simulate(seed, costs).makespan)
    model.precedences()
    model.fifo()
    for w in range(shape.depth):
        model.m.AddNoOverlap(model.per_worker[w])
        model.m.AddCumulative(model.alive[w], [1] * len(model.alive[w]), int(math.floor(cap + 1e-9)))
    model.m.Minimize(model.makespan)
    for e in simulate(seed, costs).events:
        a = e.action
        model.m.AddHint(model.start[(a.op.value, a.mb, a.stage)][0], model.ticks(e.start))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = effort
    if solver.Solve(model.m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    orders = [[] for _ in range(shape.depth)]
    for (op, mb, s), (x, _) in model.start.items():
        p = shape.mb_pipeline[mb]
        orders[shape.placement[p][s]].append((solver.Value(x), Action(Op(op), mb, p, s)))
    return _as_schedule(shape, [[a for _, a in sorted(o)] for o in orders])


class _Model:
    """One interval per action (op in ``ops``: F and B, or F, I and W), on a time grid fine enough for
    every cost; a micro-batch is alive from its forward to its last backward pass."""

    def __init__(self, m, shape: Shape, costs: CostModel, ops: str, seed_makespan: float):
        self.m, self.shape, self.ops = m, shape, ops
        probe = shape.empty("probe")
        durations = {(op, s): costs.compute_time(probe, Action(Op(op), 0, p, s))
                     for p, row in enumerate(shape.placement) for s in range(len(row)) for op in ops}
        transfer = costs.transfer_time(probe)
        positive = [d for d in list(durations.values()) + [transfer] if d > 0]
        self.quantum = min(positive) / 8 if positive else 1.0
        self.hop = self.ticks(transfer)
        horizon = self.ticks(seed_makespan) + 1
        self.start, self.per_worker = {}, [[] for _ in range(shape.depth)]
        self.alive = [[] for _ in range(shape.depth)]
        self.makespan = m.NewIntVar(0, horizon, "makespan")
        for mb, p in enumerate(shape.mb_pipeline):
            for s, w in enumerate(shape.placement[p]):
                for op in ops:
                    d = max(1, self.ticks(durations[(op, s)]))
                    x = m.NewIntVar(0, horizon, f"{op}{mb}s{s}")
                    self.start[(op, mb, s)] = (x, d)
                    self.per_worker[w].append(m.NewIntervalVar(x, d, x + d, ""))
                (f, _), (last, ld) = self.start[("F", mb, s)], self.start[(ops[-1], mb, s)]
                self.alive[w].append(m.NewIntervalVar(f, m.NewIntVar(1, horizon, ""), last + ld, ""))
                m.Add(self.makespan >= last + ld)

    def ticks(self, t: float) -> int:
        return int(round(t / self.quantum))

    def precedences(self) -> None:
        """Each action after the results it consumes (the dataflow rule: forwards down the pipeline, the
        input gradient back up, W after its I), one hop later when they come from another worker. A
        backward that waits for the next stage's gradient needs no constraint for its own forward,
        which that gradient already follows (a redundant constraint only slows the solver)."""
        split, last = "W" in self.ops, self.shape.depth - 1
        for (op, mb, s), (x, _) in self.start.items():
            row = self.shape.placement[self.shape.mb_pipeline[mb]]
            deps = dependencies(Action(Op(op), mb, self.shape.mb_pipeline[mb], s), last)
            for key in [k for k in deps if k[2] != s] or deps:
                src = producer(key, split)
                y, d = self.start[(src.op.value, src.mb, src.stage)]
                self.m.Add(x >= y + d + (self.hop if row[src.stage] != row[s] else 0))

    def fifo(self) -> None:
        """Each pipeline's micro-batches in order at every stage, for every op (a symmetry break)."""
        for p in set(self.shape.mb_pipeline):
            mbs = [mb for mb, q in enumerate(self.shape.mb_pipeline) if q == p]
            for x, y in zip(mbs, mbs[1:]):
                for s in range(self.shape.depth):
                    for op in self.ops:
                        self.m.Add(self.start[(op, x, s)][0] < self.start[(op, y, s)][0])
