"""Replay of a compute schedule: every worker runs its list in order; an action starts when the worker
is free and its inputs (the dataflow rule) have arrived. The validator asks whether it finishes; the
simulator and lowering read its times. Sends never block, so the only way to get stuck is a real
dependency cycle, which is named. An overlapped action starts when either part's input is there, each
part waiting only for its own (``CostModel.run_times``), and hands on each part's result when that part
ends; the worker is free when both have."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.actions import Action, Op, parts
from ..ir.costs import CostModel, Event
from ..ir.dataflow import dependencies, describe, products
from ..ir.errors import InvalidSchedule
from ..ir.schedule import Schedule


@dataclass
class TimedReplay:
    """A compute schedule replayed under costs: each compute action's times, the gradient reductions
    each stage's copies posted (time, worker, R), and when each worker is free at the end."""

    events: list[Event] = field(default_factory=list)
    posts: dict[int, list[tuple[float, int, Action]]] = field(default_factory=dict)
    free: list[float] = field(default_factory=list)


def replay(schedule: Schedule, costs: CostModel, whole_pairs: bool = False) -> TimedReplay:
    """Run every worker's list in order under ``costs``; raise InvalidSchedule naming the wait-for
    cycle if no worker can make progress. ``whole_pairs``: an overlapped action waits for both parts'
    inputs before it starts and hands on both results when it ends (lowering's order: it receives both
    before the action and sends both after it)."""
    last = schedule.stages_per_pipeline - 1
    transfer = costs.transfer_time(schedule)
    done: dict[tuple, tuple[int, float]] = {}
    pos = [0] * schedule.num_workers
    out = TimedReplay(free=[0.0] * schedule.num_workers)
    progress = True
    while progress:
        progress = False
        for w, actions in enumerate(schedule.workers):
            while pos[w] < len(actions):
                a = actions[pos[w]]
                deps = dependencies(a, last)
                if any(d not in done for d in deps):
                    break
                if a.op is Op.REDUCE_GRADS:
                    out.posts.setdefault(a.stage, []).append((out.free[w], w, a))
                else:
                    arrival = lambda d: done[d][1] + (transfer if done[d][0] != w else 0.0)  # noqa: E731
                    ready = [max((arrival(d) for d in dependencies(p, last)), default=0.0) for p in parts(a)]
                    if whole_pairs:
                        ready = [max(ready)] * len(ready)
                    start, ends = costs.run_times(schedule, a, out.free[w], ready)
                    if whole_pairs:
                        ends = [max(ends)] * len(ends)
                    out.events.append(Event(w, a, start, max(ends)))
                    out.free[w] = max(ends)
                    for p, end in zip(parts(a), ends):
                        for key in products(p):
                            done[key] = (w, end)
                pos[w] += 1
                progress = True
    stuck = [w for w in range(schedule.num_workers) if pos[w] < len(schedule.workers[w])]
    if stuck:
        raise _deadlock(schedule, pos, done, stuck)
    return out


def _deadlock(schedule: Schedule, pos: list[int], done: dict, stuck: list[int]) -> InvalidSchedule:
    """Follow 'waits for' from the first stuck worker until a worker repeats: that is the cycle."""
    last = schedule.stages_per_pipeline - 1
    producer = {}
    for w, actions in enumerate(schedule.workers):
        for a in actions:
            for key in products(a):
                producer.setdefault(key, (w, a))
    chain, w = [], stuck[0]
    while w not in [c[0] for c in chain]:
        head = schedule.workers[w][pos[w]]
        missing = next(d for d in dependencies(head, last) if d not in done)
        if missing not in producer:
            return InvalidSchedule(f"waits for {describe(missing)}, which no worker produces", w, head)
        chain.append((w, head, missing))
        w = producer[missing][0]
    start = [c[0] for c in chain].index(w)
    cycle = " -> ".join(f"worker {cw} at {h} waits for {describe(k)}" for cw, h, k in chain[start:])
    first_w, first_a, _ = chain[start]
    return InvalidSchedule(f"deadlock: cross-worker cycle: {cycle}", first_w, first_a)
