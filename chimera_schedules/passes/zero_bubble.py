"""Split backward (zero-bubble style, Qi et al. 2024): every B becomes I, the input gradient the
previous stage waits for, and W, the weight gradients nobody waits for, placed into the bubbles.

``split_backward`` keeps a schedule's order of forwards and input gradients and places the W passes
by a replay under the given costs: a free worker runs its next F or I as soon as that is ready; while
it waits, it runs its oldest pending W, unless the next F or I would be ready before that W ends. A
micro-batch's activations stay alive from its F until its W ends, and a worker never holds more than
``cap`` of them: a forward that would exceed it waits for W passes to free one. Every W still pending
when the forwards and input gradients are done runs at the end, oldest first.

- 1F1B split is ZB-H1: 1F1B's order, each worker capped at 1F1B's own peak (D - w micro-batches), so
  activation memory stays 1F1B's; at F = I = W its idle time is (D-1)(F + B - 2W).
- Chimera split is the paper's order with W moved into the bubbles, capped at D micro-batches per
  worker (the most a worker holds in the unsplit basic unit).

The registry overlaps forwards and backwards after this pass; an overlapped B given here becomes an
overlapped I, read through its parts.
"""
from __future__ import annotations

import heapq
from dataclasses import replace

from ..ir.actions import Action, Halved, Op, Overlapped, parts
from ..ir.costs import CostModel, activation_units
from ..ir.dataflow import dependencies, products
from ..ir.schedule import Schedule
from .grad_sync import with_grad_sync


def split_backward(schedule: Schedule, costs: CostModel, cap: list[float]) -> Schedule:
    """``schedule`` (with B passes) with every B split into I and a W placed as described above."""
    queues = [[_input_pass(a) for a in schedule.compute(w)] for w in range(schedule.num_workers)]
    orders = _WeightPlacer(replace(schedule, workers=tuple(map(tuple, queues))), costs, cap).run()
    return with_grad_sync(replace(schedule, name=f"{schedule.name}-split", workers=tuple(map(tuple, orders))))


def _input_pass(a: Action | Overlapped | Halved) -> Action | Overlapped | Halved:
    """The action with its B (alone, overlapped or halved) as an I."""
    if a.op is Op.OVERLAPPED:
        return Overlapped(a.forward, _input_pass(a.backward))
    if a.op is Op.HALVED:
        return Halved(_input_pass(a.action))
    return Action(Op.BACKWARD_INPUT, a.mb, a.pipeline, a.stage) if a.op is Op.BACKWARD else a


class _WeightPlacer:
    """Event-driven: each worker, when free, decides at the time of the latest event it has seen."""

    def __init__(self, schedule: Schedule, costs: CostModel, cap: list[float]):
        self.s, self.costs, self.cap = schedule, costs, cap
        self.last = schedule.stages_per_pipeline - 1
        self.transfer = costs.transfer_time(schedule)
        self.done: dict[tuple, tuple[int, float]] = {}
        workers = schedule.num_workers
        self.queue = [list(a) for a in schedule.workers]
        self.pending: list[list[Action]] = [[] for _ in range(workers)]  # W passes, oldest first
        self.free, self.live = [0.0] * workers, [0.0] * workers
        self.ends: list[float] = []  # heap of the end times of started actions
        self.orders: list[list[Action]] = [[] for _ in range(workers)]

    def ready_at(self, w: int, a: Action) -> float | None:
        """When the action's inputs are on worker w; None if one is not produced yet."""
        times = []
        for key in dependencies(a, self.last):
            if key not in self.done:
                return None
            src, end = self.done[key]
            times.append(end + (self.transfer if src != w else 0.0))
        return max(times, default=0.0)

    def run(self) -> list[list[Action]]:
        while True:
            active = [w for w in range(self.s.num_workers) if self.queue[w] or self.pending[w]]
            if not active:
                return self.orders
            now = min(self.free[w] for w in active)
            idle = [w for w in active if self.free[w] <= now + 1e-9]
            if not any(self._step(w) for w in idle):
                while self.ends and self.ends[0] <= now + 1e-9:
                    heapq.heappop(self.ends)
                later = [t for t in self.ends[:1] + self.free if t > now + 1e-9]
                if not later:
                    raise AssertionError(f"split replay stuck at time {now} on workers {idle}")
                for w in idle:
                    self.free[w] = min(later)

    def _step(self, w: int) -> bool:
        """Start one action on worker w at its free time, or move its free time to when its next F or
        I is ready; False if it has to wait for something not yet known."""
        now, head = self.free[w], self.queue[w][0] if self.queue[w] else None
        ready = self.ready_at(w, head) if head is not None else None
        grows = [activation_units(self.s, p) for p in parts(head) if p.op is Op.FORWARD] if head else []
        fits = not grows or self.live[w] + grows[0] <= self.cap[w] + 1e-9
        if ready is not None and ready <= now + 1e-9 and fits:
            self._start(w, self.queue[w].pop(0), now)
        elif self.pending[w] and (not fits or ready is None or
                                  ready - now >= self.costs.compute_time(self.s, self.pending[w][0]) - 1e-9):
            self._start(w, self.pending[w].pop(0), now)
        elif ready is not None and fits:
            self.free[w] = ready
        else:
            return False
        return True

    def _start(self, w: int, a: Action, at: float) -> None:
        end = at + self.costs.compute_time(self.s, a)
        heapq.heappush(self.ends, end)
        self.free[w] = end
        self.orders[w].append(a)
        for key in products(a):
            self.done[key] = (w, end)
        for part in parts(a):
            if part.op is Op.FORWARD:
                self.live[w] += activation_units(self.s, part)
            elif part.op is Op.BACKWARD_INPUT:
                self.pending[w].append(Action(Op.BACKWARD_WEIGHT, part.mb, part.pipeline, part.stage))
            else:
                self.live[w] -= activation_units(self.s, part)
