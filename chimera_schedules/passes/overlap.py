"""Overlapped forward and backward, DualPipe style: on each worker, a forward and the backward (or I) of
another micro-batch that sit next to each other in its list run as one ``Overlapped`` action, so one
micro-batch's expert all-to-all is in flight while the other computes (``ir/parts.py`` prices it); and
an action with no partner runs as two halves of its micro-batch that hide each other's (``Halved``).

``overlap_forward_backward(schedule, costs, halves)`` chooses among plain actions, pairs and halves,
judged at the caller's costs when they have an all-to-all, else at ``REFERENCE`` (an all-to-all of half
a forward). The pairs: it replays the schedule and keeps each candidate pair, earliest first, when the
schedule still replays and is no slower. The halves: a micro-batch's forward and backward on one stage
copy, neither in a pair, are halved together when that makes them shorter, which can only move what
follows earlier (together: a backward runs in the halves its forward ran in). Two orders are built and
the faster kept: today's pairs, then halves for the rest; halves alone. The first is never slower than
the pairs alone, so neither is the result. Why 1F1B's and Chimera's pairs rarely pay and DualPipe's
do, the rules for keeping a pair, and how a trial avoids replaying everything: docs/notes/overlap-pass.md.
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from functools import partial

from ..analysis.replay import replay
from ..analysis.simulator import reduce_windows, simulate
from ..ir.actions import HALVABLE_OPS, Action, Halved, Op, Overlapped
from ..ir.costs import CostModel, has_a2a
from ..ir.dataflow import dependencies, products
from ..ir.schedule import Schedule

REFERENCE = CostModel(forward=1.0, backward=2.0, a2a=0.5, moe_layers=4)
"""The costs that judge the pairs when the caller's have no all-to-all: the 1F1B stage's forward 1 and
backward 2, an all-to-all of half a forward (the depth benchmark's ``--a2a-fraction 0.5``), four MoE
layers per stage."""

_FUSABLE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT)
_TOLERANCE = 1e-9


def overlap_forward_backward(schedule: Schedule, costs: CostModel | None = None, halves: bool = True) -> Schedule:
    """``schedule`` (a compute schedule) with adjacent F and B-or-I pairs of two micro-batches fused into
    overlapped actions and, with ``halves``, the passes that gain by it halved: the faster of the
    module's two orders under ``costs`` (``REFERENCE`` when they have no all-to-all); ``meta["overlap"]``
    set."""
    if schedule.lowered:
        raise ValueError("overlap a compute schedule: lowering places messages around the fused actions")
    judge = costs if costs is not None and has_a2a(costs) else REFERENCE
    paired = _fuse_pairs(schedule, judge)
    if halves:
        orders = [halve(paired, judge), halve(schedule, judge)]
        paired = min(orders, key=lambda order: simulate(order, judge).makespan)  # the first of equals
    return replace(paired, meta={**schedule.meta, "overlap": True})


def _fuse_pairs(schedule: Schedule, costs: CostModel) -> Schedule:
    """The pairs that do not make ``schedule`` slower, fused."""
    timed = _Timed(schedule, costs)
    for i, j in timed.candidates():
        timed.try_pair(i, j)
    return replace(schedule, workers=timed.workers())


def halve(schedule: Schedule, costs: CostModel) -> Schedule:
    """Each micro-batch's forward and backward (B or I) on one stage copy halved together where neither is
    in a pair and the two are shorter in halves: a backward runs in the halves its forward ran in (the
    executor keeps one schedule plan per half), so the two are halved or whole together."""
    plain = [a for actions in schedule.workers for a in actions if a.op in HALVABLE_OPS]
    passes: dict[tuple[int, int, int], list[Action]] = {}
    for a in plain:
        passes.setdefault((a.mb, a.pipeline, a.stage), []).append(a)
    time = partial(costs.compute_time, schedule)
    halved = {a for both in passes.values() if len(both) == 2
              and sum(map(time, map(Halved, both))) < sum(map(time, both)) - _TOLERANCE for a in both}
    return replace(schedule, workers=tuple(tuple(Halved(a) if a in halved else a for a in actions)
                                           for actions in schedule.workers))


class _Timed:
    """The schedule's compute actions, numbered, with their times in the replay of the pairs fused so far
    and their tails: the longest chain of actions and transfers from one's end to the iteration's end.
    A pair is its two actions with one start, one end and one tail; ``mate[i]`` is the second part of the
    pair whose first (in the worker's list) is i, ``head[j]`` the first part of j's pair (j alone)."""

    def __init__(self, schedule: Schedule, costs: CostModel):
        self.s, self.costs = schedule, costs
        lists = [[a for a in actions if a.op is not Op.REDUCE_GRADS] for actions in schedule.workers]
        self.action = [a for actions in lists for a in actions]
        ids = {a: i for i, a in enumerate(self.action)}
        self.seq = [[ids[a] for a in actions] for actions in lists]
        self.worker = [w for w, actions in enumerate(self.seq) for _ in actions]
        self.index = [k for actions in self.seq for k in range(len(actions))]  # place in the worker's list
        made = {key: i for i, a in enumerate(self.action) for key in products(a)}
        last = schedule.stages_per_pipeline - 1
        self.deps = [[made[key] for key in dependencies(a, last)] for a in self.action]
        transfer = costs.transfer_time(schedule)
        # each action's inputs and users, with the transfer between them (none on one worker)
        self.inputs = [[(d, transfer if self.worker[d] != self.worker[i] else 0.0) for d in deps]
                       for i, deps in enumerate(self.deps)]
        self.users = [[] for _ in self.action]
        for i, inputs in enumerate(self.inputs):
            for d, gap in inputs:
                self.users[d].append((i, gap))
        self.time = [costs.compute_time(schedule, a) for a in self.action]
        self.reductions = []  # (worker, R, the compute action before it or None): R posts when that ends
        for w, actions in enumerate(schedule.workers):
            before = None
            for a in actions:
                if a.op is Op.REDUCE_GRADS:
                    self.reductions.append((w, a, before))
                else:
                    before = ids[a]
        n = len(self.action)
        self.mate, self.head = [-1] * n, list(range(n))
        self.pair_time: dict[int, float] = {}
        self.start, self.end, self.tail, self.rank = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
        for rank, e in enumerate(replay(schedule, costs).events):  # raises if the schedule deadlocks
            i = ids[e.action]
            self.start[i], self.end[i], self.rank[i] = e.start, e.end, rank
        for h in sorted(range(n), key=self._key, reverse=True):
            self.tail[h] = self._tail(h)
        self.makespan, self.area = self._makespan(), sum(self.end)
        self.first_start = list(self.start)  # the unfused replay's, which order the candidates

    def candidates(self) -> list[tuple[int, int]]:
        """Adjacent F and B-or-I of two micro-batches, each taking some time (else there is nothing to
        hide), earliest start in the unfused replay first."""
        out = []
        for seq in self.seq:
            for i, j in zip(seq, seq[1:]):
                a, b = self.action[i], self.action[j]
                ops = {a.op, b.op}
                if (Op.FORWARD in ops and len(ops) == 2 and ops <= set(_FUSABLE) and a.mb != b.mb and
                        self.time[i] > 0 and self.time[j] > 0):
                    out.append((i, j))
        return sorted(out, key=lambda pair: (self.first_start[pair[0]], self.worker[pair[0]]))

    def try_pair(self, i: int, j: int) -> bool:
        """Fuse i and the next action j of its worker if neither is in a pair, the schedule still
        replays, and it is no worse; whether it was fused."""
        if self.mate[i] >= 0 or self.head[i] != i or self.mate[j] >= 0 or self.head[j] != j:
            return False
        if self._leads_to_inputs(i, j):
            return False  # a deadlock: the pair would wait for its own result
        self.mate[i], self.head[j] = j, i
        log: list[tuple[int, float, float]] = []  # (action, start, end) before the trial, to undo it
        if self._retime(i, log):
            makespan, area = self._makespan(), self.area + sum(self.end[p] - end for p, _, end in log)
            if makespan < self.makespan - _TOLERANCE or (makespan <= self.makespan + _TOLERANCE and
                                                         area <= self.area + _TOLERANCE):
                self.makespan, self.area = makespan, area
                self._retail(i)
                return True
        for p, start, end in reversed(log):
            self.start[p], self.end[p] = start, end
        self.mate[i], self.head[j] = -1, j
        return False

    def _key(self, h: int) -> tuple[float, float, int]:
        """An order of the actions (pairs by their first part) with each after what it waits on: times
        grow along a chain, and the unfused replay's order breaks the ties of actions that take no time
        (a pair takes some)."""
        return self.start[h], self.end[h], self.rank[h]

    def _parts(self, h: int) -> tuple[int, ...]:
        return (h,) if self.mate[h] < 0 else (h, self.mate[h])

    def _took(self, h: int) -> float:
        if self.mate[h] < 0:
            return self.time[h]
        if h not in self.pair_time:  # h pairs with the next action of its worker only
            self.pair_time[h] = self.costs.compute_time(self.s, self._pair(h))
        return self.pair_time[h]

    def _after(self, h: int) -> list[tuple[int, float]]:
        """What waits on action (or pair) h, each with the transfer between: the actions that use its
        results, and its worker's next one."""
        head, j = self.head, self.mate[h]
        out = [(head[u], gap) for u, gap in self.users[h]]
        if j >= 0:
            out += [(head[u], gap) for u, gap in self.users[j]]
        seq, k = self.seq[self.worker[h]], self.index[h if j < 0 else j] + 1
        if k < len(seq):
            out.append((head[seq[k]], 0.0))
        return out

    def _before(self, h: int) -> list[tuple[int, float]]:
        """What h waits on, each with the transfer between: the makers of its inputs and its worker's
        previous action."""
        out = [(self.head[d], gap) for p in self._parts(h) for d, gap in self.inputs[p]]
        if self.index[h]:
            out.append((self.head[self.seq[self.worker[h]][self.index[h] - 1]], 0.0))
        return out

    def _leads_to_inputs(self, i: int, j: int) -> bool:
        """Whether what i's results lead to, through any worker, includes a maker of j's inputs. Those
        end before j starts, and times grow along a path, so only actions starting before j are looked at."""
        targets = {self.head[d] for d in self.deps[j]}
        seen, todo = {i}, [self.head[u] for u, _ in self.users[i]]
        while todo:
            h = todo.pop()
            if h in seen or self.start[h] > self.start[j]:
                continue
            if h in targets:
                return True
            seen.add(h)
            todo += [u for u, _ in self._after(h)]
        return False

    def _times(self, h: int) -> tuple[float, float]:
        """When action (or pair) h starts and ends, given its worker's previous action and its inputs."""
        end, first = self.end, self.index[h]
        start = end[self.seq[self.worker[h]][first - 1]] if first else 0.0
        for p in self._parts(h):
            for d, gap in self.inputs[p]:
                if end[d] + gap > start:
                    start = end[d] + gap
        return start, start + self._took(h)

    def _tail(self, h: int) -> float:
        return max((gap + self._took(u) + self.tail[u] for u, gap in self._after(h)), default=0.0)

    def _retime(self, pair: int, log: list) -> bool:
        """Retime the new pair and what waits on it, in the order the actions started before the trial
        (what can move is the pair's descendants, and that order has each after what it waits on), and
        stop where times stay: an action is looked at again only when what it waits on now ends after
        it starts, or ended just as it started and moved. False as soon as an action ends too late for
        the makespan to stay (its end and its tail, which the pair cannot shorten, pass it)."""
        limit, heap, queued = self.makespan + _TOLERANCE, [(self._key(pair), pair)], {pair}
        starts, ends, tails, rank = self.start, self.end, self.tail, self.rank
        while heap:
            _, h = heapq.heappop(heap)
            start, end = self._times(h)
            was = ends[h]
            if h == pair:
                tail, was = self._tail(h), None  # each part ended at its own time: look at all
            elif start == starts[h] and end == was:
                continue
            else:
                tail = tails[h]
            for p in self._parts(h):
                log.append((p, starts[p], ends[p]))
                starts[p], ends[p] = start, end
            if end + tail > limit:
                return False
            for u, gap in self._after(h):
                if u not in queued and (was is None or end + gap > starts[u] or was + gap >= starts[u]):
                    queued.add(u)
                    heapq.heappush(heap, ((starts[u], ends[u], rank[u]), u))
        return True

    def _retail(self, pair: int) -> None:
        """After a pair is fused: the tails of it and of what it waits on, latest first, stopping where
        a tail stays (as ``_retime`` does, backwards)."""
        heap, queued, tails = [(_reverse(self._key(pair)), pair)], {pair}, self.tail
        while heap:
            _, h = heapq.heappop(heap)
            tail, was = self._tail(h), tails[h]
            if h == pair:
                was = None  # the pair's parts had their own tails and times: look at all
            elif tail == was:
                continue
            took = self._took(h)
            for p in self._parts(h):
                tails[p] = tail
            for u, gap in self._before(h):
                if u not in queued and (was is None or gap + took + tail > tails[u] or gap + took + was >= tails[u]):
                    queued.add(u)
                    heapq.heappush(heap, (_reverse(self._key(u)), u))

    def _makespan(self) -> float:
        """The last compute action's end, or the last gradient reduction's (``analysis/simulator.py``)."""
        finish = max((self.end[seq[-1]] for seq in self.seq if seq), default=0.0)
        if not self.reductions:
            return finish
        posts: dict = {}
        for w, a, before in self.reductions:
            posts.setdefault(a.stage, []).append((self.end[before] if before is not None else 0.0, w, a))
        return max([finish] + [e.end for e in reduce_windows(self.s, self.costs, posts)])

    def workers(self) -> tuple[tuple[Action | Overlapped, ...], ...]:
        """The worker lists with the pairs fused at the place of their first part; the gradient
        reductions between a pair's parts follow the pair."""
        ids = {a: i for i, a in enumerate(self.action)}
        out = []
        for actions in self.s.workers:
            row, between, inside = [], [], False
            for a in actions:
                if a.op is Op.REDUCE_GRADS:
                    (between if inside else row).append(a)
                    continue
                i = ids[a]
                if self.mate[i] >= 0:
                    row.append(self._pair(i))
                    inside = True
                elif self.head[i] != i:
                    row += between
                    between, inside = [], False
                else:
                    row.append(a)
            out.append(tuple(row))
        return tuple(out)

    def _pair(self, h: int) -> Overlapped:
        a, b = self.action[h], self.action[self.mate[h]]
        return Overlapped(a, b) if a.op is Op.FORWARD else Overlapped(b, a)


def _reverse(key: tuple[float, float, int]) -> tuple[float, float, int]:
    return -key[0], -key[1], -key[2]
