"""A local search over each worker's order at the run's own stage costs: the last step of ``--order best``.

Chimera's orders count F, B and W slots; they do not see that one stage costs more than the others
(the output layer and MTP on the last stage, the embedding on the first). Where the costly stage's
worker waits, the whole iteration waits. This search moves actions within a worker's list to close
those waits, under the same memory cap.

The evaluator compiles a compute schedule to integer action ids: each action's duration at the
caller's costs (a halved or overlapped action priced whole, as ``CostModel.compute_time`` prices it,
its results handed on when it ends), the actions it waits for (the dataflow rule), one message's delay
between workers, and each action's step in its worker's live activations. A replay of D = 8, N = 16
takes about a third of a millisecond, so a search can try tens of thousands of orders.

Moves: within one worker's list, move an action up to ``WINDOW`` places earlier or later, or swap two
actions at most ``WINDOW`` apart (a swap is two moves that only pay together: a forward that must
leave room for another direction's micro-batch). A move is kept when the order still replays (no
dependency cycle), every worker stays within the memory cap, and the workers' finish times, sorted from
the last, get lexicographically smaller: the makespan first, then the next worker's, so that shortening
one of two workers tied at the end counts. Insert and swap passes alternate until a pair of passes
changes nothing, the evaluation budget is spent, or the makespan reaches the busiest worker's compute
(no order can end before it; ``Compiled.floor``). Everything is deterministic, so every rank that
builds the schedule builds the same one. Gradient reductions are placed again afterwards.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir.actions import Op, parts
from ..ir.costs import CostModel, activation_units
from ..ir.dataflow import dependencies, products
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync

WINDOW = 12  # places an action moves, or two swapped actions lie apart
_GROWS, _SHRINKS = (Op.FORWARD,), (Op.BACKWARD, Op.BACKWARD_WEIGHT)


class Compiled:
    """A compute schedule as integer action ids, replayed fast under fixed costs."""

    def __init__(self, schedule: Schedule, costs: CostModel):
        self.schedule = schedule
        last = schedule.stages_per_pipeline - 1
        self.actions = [a for actions in schedule.workers for a in actions if a.op is not Op.REDUCE_GRADS]
        index = {a: i for i, a in enumerate(self.actions)}
        self.initial = [[index[a] for a in actions if a in index] for actions in schedule.workers]
        self.worker = [0] * len(self.actions)
        for w, order in enumerate(self.initial):
            for i in order:
                self.worker[i] = w
        producer = {key: index[a] for a in self.actions for key in products(a)}
        self.waits = [tuple(sorted({producer[k] for k in dependencies(a, last)})) for a in self.actions]
        self.duration = [costs.compute_time(schedule, a) for a in self.actions]
        self.transfer = costs.transfer_time(schedule)
        self.step, self.peak_in = zip(*(self._memory(a) for a in self.actions))

    def _memory(self, action) -> tuple[float, float]:
        """An action's change to its worker's live activations, and the highest it takes them above
        where they started (an overlapped action allocates its forward before its backward frees)."""
        live = peak = 0.0
        for part in parts(action):
            units = activation_units(self.schedule, part)
            live += units if part.op in _GROWS else -units if part.op in _SHRINKS else 0.0
            peak = max(peak, live)
        return live, peak

    def floor(self) -> float:
        """The busiest worker's compute: no order of these actions ends before it."""
        return max(sum(self.duration[i] for i in order) for order in self.initial)

    def peak(self, order: list[int]) -> float:
        live = peak = 0.0
        for i in order:
            peak = max(peak, live + self.peak_in[i])
            live += self.step[i]
        return peak

    def finish(self, orders: list[list[int]]) -> list[float] | None:
        """When each worker ends its list, or None if the orders wait on each other in a cycle."""
        end: list[float | None] = [None] * len(self.actions)
        pos, free = [0] * len(orders), [0.0] * len(orders)
        progress = True
        while progress:
            progress = False
            for w, order in enumerate(orders):
                p, t = pos[w], free[w]
                while p < len(order):
                    i, start = order[p], t
                    for d in self.waits[i]:
                        if end[d] is None:
                            break
                        start = max(start, end[d] + (self.transfer if self.worker[d] != w else 0.0))
                    else:
                        t = end[i] = start + self.duration[i]
                        p += 1
                        continue
                    break
                progress |= p > pos[w]
                pos[w], free[w] = p, t
        return free if all(p == len(o) for p, o in zip(pos, orders)) else None

    def schedule_of(self, orders: list[list[int]]) -> Schedule:
        return with_grad_sync(replace(self.schedule, workers=tuple(tuple(self.actions[i] for i in order)
                                                                  for order in orders)))


def _key(finish: list[float]) -> tuple[float, ...]:
    return tuple(sorted((round(f, 9) for f in finish), reverse=True))


class _Search:
    """Hill climbing over insert and swap moves (the module says which are kept)."""

    def __init__(self, compiled: Compiled, cap: float, budget: int):
        self.compiled, self.cap, self.budget = compiled, cap + 1e-9, budget
        self.orders = [order[:] for order in compiled.initial]
        self.best = _key(compiled.finish(self.orders))
        self.floor = round(compiled.floor(), 9)

    @property
    def done(self) -> bool:
        return self.budget <= 0 or self.best[0] <= self.floor

    def run(self) -> list[list[int]]:
        while not self.done:
            start = self.best
            for swap in (False, True):
                self._pass(swap)
            if self.best == start:
                break
        return self.orders

    def _pass(self, swap: bool) -> None:
        for w, order in enumerate(self.orders):
            for i in range(len(order)):
                for j in range(max(0, i - WINDOW), min(len(order), i + WINDOW + 1)):
                    if j == i or (swap and j < i) or self.done:
                        continue
                    if self._try(w, _swapped(self.orders[w], i, j) if swap else _moved(self.orders[w], i, j)):
                        break

    def _try(self, w: int, candidate: list[int]) -> bool:
        if self.compiled.peak(candidate) > self.cap:
            return False
        self.budget -= 1
        kept, self.orders[w] = self.orders[w], candidate
        finish = self.compiled.finish(self.orders)
        if finish is not None and _key(finish) < self.best:
            self.best = _key(finish)
            return True
        self.orders[w] = kept
        return False


def _moved(order: list[int], i: int, j: int) -> list[int]:
    out = order[:]
    out.insert(j, out.pop(i))
    return out


def _swapped(order: list[int], i: int, j: int) -> list[int]:
    out = order[:]
    out[i], out[j] = out[j], out[i]
    return out


def improve(schedule: Schedule, costs: CostModel, cap: float, budget: int) -> tuple[Schedule, bool]:
    """``schedule`` (a compute schedule) with each worker's list reordered by the search, at most ``cap``
    live micro-batches (M_a) per worker and at most ``budget`` orders replayed; and whether its makespan
    reached the floor (no order can be shorter)."""
    compiled = Compiled(schedule, costs)
    search = _Search(compiled, cap, budget)
    orders = search.run()
    return compiled.schedule_of(orders), search.best[0] <= search.floor
