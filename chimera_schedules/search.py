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
"""
from __future__ import annotations

import math

from .chimera import check, chimera, mb_pipelines, placement
from .ir import Action, B, F, Schedule, with_grad_sync
from .listsched import Shape, list_schedule
from .simulator import CostModel, peak_activations, simulate


def best_order(stages: int, microbatches: int, costs: CostModel | None = None, pipelines: int = 2,
               effort: float = 5.0) -> Schedule:
    """At most D live micro-batches per worker. ``effort`` is the solver's deterministic time budget
    (roughly three wall seconds per unit on a 2-core machine)."""
    check(stages, microbatches, pipelines, "direct")
    costs = costs or CostModel()
    cap = stages
    paper = chimera(stages, microbatches, pipelines, "direct", costs)
    shape = Shape(stages, microbatches, placement(stages, pipelines), mb_pipelines(microbatches, pipelines))
    candidates = [paper]
    listed = list_schedule(shape, costs, cap=cap)
    if listed is not None:
        candidates.append(_as_schedule(shape, listed))
    candidates = [c for c in candidates if max(peak_activations(c)) <= cap + 1e-9]
    seed = min(candidates, key=lambda c: simulate(c, costs).makespan)
    solved = _solve(shape, costs, cap, seed, effort)
    if solved is not None:
        candidates.append(solved)
    best = min(candidates, key=lambda c: simulate(c, costs).makespan)  # min keeps the first of equals
    return Schedule("chimera-best", stages, microbatches, best.placement, best.workers,
                    meta={"concat": "direct", "order": "best", "cap": cap})


def _as_schedule(shape: Shape, orders: list[list[Action]]) -> Schedule:
    return with_grad_sync(Schedule("chimera-best", shape.stages, shape.microbatches, shape.placement,
                                   tuple(map(tuple, orders))))


def _solve(shape: Shape, costs: CostModel, cap: float, seed: Schedule, effort: float) -> Schedule | None:
    from ortools.sat.python import cp_model

    probe = shape.empty("probe")
    durations = {}
    for p, row in enumerate(shape.placement):
        for s in range(len(row)):
            for make in (F, B):
                a = make(0, p, s)
                durations[(a.op.value, s)] = costs.compute_time(probe, a)
    transfer = costs.transfer_time(probe)
    positive = [d for d in list(durations.values()) + [transfer] if d > 0]
    quantum = min(positive) / 8 if positive else 1.0

    def ticks(t: float) -> int:
        return int(round(t / quantum))

    m = cp_model.CpModel()
    horizon = ticks(simulate(seed, costs).makespan) + 1
    start, per_worker, alive = {}, [[] for _ in range(shape.stages)], [[] for _ in range(shape.stages)]
    makespan = m.NewIntVar(0, horizon, "makespan")
    for mb, p in enumerate(shape.mb_pipeline):
        for s, w in enumerate(shape.placement[p]):
            for op in "FB":
                d = max(1, ticks(durations[(op, s)]))
                x = m.NewIntVar(0, horizon, f"{op}{mb}s{s}")
                start[(op, mb, s)] = (x, d)
                per_worker[w].append(m.NewIntervalVar(x, d, x + d, ""))
            (f, fd), (b, bd) = start[("F", mb, s)], start[("B", mb, s)]
            alive[w].append(m.NewIntervalVar(f, m.NewIntVar(1, horizon, ""), b + bd, ""))
            m.Add(makespan >= b + bd)
    last = shape.stages - 1
    hop = ticks(transfer)
    for mb, p in enumerate(shape.mb_pipeline):
        row = shape.placement[p]
        for s in range(shape.stages):
            f, fd = start[("F", mb, s)]
            b, bd = start[("B", mb, s)]
            if s > 0:
                prev, pd = start[("F", mb, s - 1)]
                m.Add(f >= prev + pd + (hop if row[s - 1] != row[s] else 0))
            if s < last:
                nxt, nd = start[("B", mb, s + 1)]
                m.Add(b >= nxt + nd + (hop if row[s + 1] != row[s] else 0))
            else:
                m.Add(b >= f + fd)
    for p in set(shape.mb_pipeline):
        mbs = [mb for mb, q in enumerate(shape.mb_pipeline) if q == p]
        for x, y in zip(mbs, mbs[1:]):
            for s in range(shape.stages):
                for op in "FB":
                    m.Add(start[(op, x, s)][0] < start[(op, y, s)][0])
    for w in range(shape.stages):
        m.AddNoOverlap(per_worker[w])
        m.AddCumulative(alive[w], [1] * len(alive[w]), int(math.floor(cap + 1e-9)))
    m.Minimize(makespan)
    for e in simulate(seed, costs).events:
        a = e.action
        m.AddHint(start[(a.op.value, a.mb, a.stage)][0], ticks(e.start))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = effort
    if solver.Solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    orders = [[] for _ in range(shape.stages)]
    for (op, mb, s), (x, _) in start.items():
        p = shape.mb_pipeline[mb]
        orders[shape.placement[p][s]].append((solver.Value(x), (F if op == "F" else B)(mb, p, s)))
    return _as_schedule(shape, [[a for _, a in sorted(o)] for o in orders])
