"""``--order best``: a memory-capped Chimera order for N = K D micro-batches.

Direct concatenation leaves bubbles between basic units when B is about 2F; forward doubling removes
them at twice the activation memory. This finds an order that keeps every worker at most ``cap``
(D, the basic unit's budget) live micro-batches and gets as close as it can to the optimal
makespan under the given costs:

1. candidates: the paper's direct concatenation, and capped list schedules at the run's costs
   (``listsched.py``: non-delay, and with a slot kept per idle stage copy, without and with patience);
2. a constraint model (OR-Tools CP-SAT): one interval per action, no overlap per worker, data
   dependencies with p2p delays, a cumulative live-activation cap per worker, each pipeline's
   micro-batches in FIFO order at every stage (the paper's convention, and a strong symmetry break),
   seeded with the best candidate and run single-threaded with a deterministic time budget, so every
   rank that builds the schedule builds the same one;
3. with ``overlap``, each candidate overlapped (``passes/overlap.py``), so that what follows orders the
   actions as they will run (the solver is skipped there: it prices every action whole);
4. each candidate reordered by the local search at the run's stage costs (``order_search.py``), which
   closes the waits of the worker whose stages cost most (DeepSeek-V3's output layer and MTP);
5. the best of all, by simulated makespan, so ``best`` is never worse than ``paper``.

With F = 1, B = 2 and no communication cost this reaches the proven optima 28 (D=4, N=8) and 52
(D=4, N=16), and 60 (D=8, N=16).

With ``split`` the backwards are I and W passes (zero_bubble.py): the candidate is the paper order
split, and the model gains a W interval per action after its I; a micro-batch is alive from its F to
the end of its W.
"""
from __future__ import annotations

import math

from ..analysis.simulator import peak_activations, simulate
from ..ir.actions import HALVABLE_OPS, Action, Halved, Op
from ..ir.costs import CostModel
from ..ir.dataflow import dependencies, producer
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync
from ..passes.overlap import overlap_forward_backward
from ..passes.zero_bubble import split_backward
from .chimera import check, chimera
from .listsched import Greed, Shape, list_schedule
from .order_search import improve
from .placement import mb_pipelines, placement

SEARCH_BUDGET = 20_000  # orders the local search replays per unit of effort (about 7 s at D=8, N=16)
PATIENCE = 0.5  # of the ranked-first action's time: how long a worker may wait for a higher-ranked one


def best_order(depth: int, microbatches: int, costs: CostModel | None = None, pipelines: int = 2,
               effort: float = 5.0, split: bool = False, overlap: bool = False, halves: bool = True) -> Schedule:
    """At most D live micro-batches per worker. ``effort`` is the solver's deterministic time budget
    (roughly three wall seconds per unit on a 2-core machine) and the local search's
    (``SEARCH_BUDGET`` orders per unit). With ``overlap`` the result is already overlapped
    (``passes/overlap.py``, with ``halves``): the search orders the actions as they will run."""
    check(depth, microbatches, pipelines, "direct")
    costs = costs or CostModel()
    cap = depth
    shape = Shape(depth, microbatches, placement(depth, pipelines), mb_pipelines(microbatches, pipelines))
    paper = chimera(depth, microbatches, pipelines, "direct", costs)
    candidates = [split_backward(paper, costs, [cap] * depth) if split else paper]
    candidates += [_as_schedule(shape, listed) for listed in _listed(shape, costs, cap, split, overlap and halves)]
    candidates = [c for c in candidates if max(peak_activations(c)) <= cap + 1e-9]
    if not overlap:  # the solver prices actions whole: with overlap it would order for other costs
        seed = min(candidates, key=lambda c: simulate(c, costs).makespan)
        solved = _solve(shape, costs, cap, seed, effort, split)
        candidates += [solved] if solved is not None else []
    if overlap:
        candidates = [overlap_forward_backward(c, costs, halves) for c in candidates]
    candidates += _improved(candidates, costs, cap, int(effort * SEARCH_BUDGET))
    best = min(candidates, key=lambda c: simulate(c, costs).makespan)  # min keeps the first of equals
    name = "chimera-split-best" if split else "chimera-best"
    return Schedule(name, depth, microbatches, best.placement, best.workers,
                    meta={"concat": "direct", "order": "best", "cap": cap, **({"overlap": True} if overlap else {})})


def _improved(candidates: list[Schedule], costs: CostModel, cap: float, budget: int) -> list[Schedule]:
    """The candidates reordered by the local search, the shortest first, until one reaches the floor."""
    out = []
    for c in sorted(candidates, key=lambda c: simulate(c, costs).makespan):
        better, floored = improve(c, costs, cap, budget)
        out.append(better)
        if floored:
            break
    return out


def _listed(shape: Shape, costs: CostModel, cap: float, split: bool, halved: bool) -> list[list[list[Action]]]:
    """The list scheduler's orders at these costs (each action priced as it will run: in halves where that is
    shorter, with ``halved``): the classic non-delay greedy, and with a slot reserved per idle stage copy,
    without and with patience. Those the cap starves are left out."""
    probe = shape.empty("probe")

    def duration(a: Action) -> float:
        whole = costs.compute_time(probe, a)
        return min(whole, costs.compute_time(probe, Halved(a))) if halved and a.op in HALVABLE_OPS else whole

    greeds = [Greed(split, duration, reserve, patience) for reserve, patience in ((False, 0.0), (True, 0.0),
                                                                                   (True, PATIENCE))]
    return [o for o in (list_schedule(shape, costs, cap=cap, greed=g) for g in greeds) if o is not None]


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
