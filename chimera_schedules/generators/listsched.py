"""Greedy list scheduling: build per-worker orders by simulating the pipeline and, whenever a worker
is free, starting the ready action it ranks first.

It serves two generators: Chimera with more than two pipelines (no closed-form order) and
``--order best`` (a memory-capped search for a shorter iteration than direct concatenation; with a
split backward it schedules F, I and W, and its orders seed the local search of ``order_search.py``).
The resulting orders are ordinary schedules: the simulator replays them to the same or an
earlier makespan, and the validator checks them like any other.

Two options serve the cost-aware search, where one worker's stages cost more than the others' (the
output layer, MTP): ``reserve`` keeps a slot of the worker's memory cap for each other stage copy it
holds that has nothing alive yet (so a worker that fills its cap with one direction's warm-up
forwards does not lock the other direction's first micro-batch out), and ``patience`` lets a worker
wait for a higher-ranked action that arrives within that share of the ranked-first action's time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..ir.actions import Action, F, Op
from ..ir.costs import CostModel, activation_units
from ..ir.dataflow import dependencies, products
from ..ir.schedule import Schedule


@dataclass(frozen=True)
class Shape:
    """What a list schedule needs to know about the pipelines: placement and each micro-batch's
    pipeline (micro-batches of one pipeline enter stage 0 in increasing order)."""

    depth: int
    microbatches: int
    placement: tuple[tuple[int, ...], ...]
    mb_pipeline: tuple[int, ...]
    virtual_stages: int = 1
    microbatch_scale: float = 1.0

    def empty(self, name: str) -> Schedule:
        return Schedule(name, self.depth, self.microbatches, self.placement,
                        tuple(() for _ in range(self.depth)), self.virtual_stages, self.microbatch_scale)


# A rule ranks a candidate, smaller first: (action, time its inputs arrived) -> key.
Rule = Callable[[Action, float], tuple]


_RANK = {Op.BACKWARD: 0, Op.BACKWARD_INPUT: 0, Op.FORWARD: 1, Op.BACKWARD_WEIGHT: 2}


def deepest_first(a: Action, ready: float) -> tuple:
    """Backward (or I) first (frees memory, unblocks the upstream stage), then forwards, then W (a
    filler); among them the deepest stage (closest to the loss, so the other direction's work is
    unblocked soonest), then the oldest micro-batch. With 1F1B's per-stage cap this reproduces the
    paper's optimal two-pipeline makespans (16 at D=4, 36 at D=8 with B = 2F) and gives D/f - 2
    bubbles per worker for 2f pipelines at unit costs."""
    return (_RANK[a.op], -a.stage, a.mb)


@dataclass(frozen=True)
class Greed:
    """How the greedy simulation decides: ``split`` schedules I and W instead of B; ``duration`` prices an
    action (``costs.compute_time`` by default); ``reserve`` and ``patience`` as the module says;
    ``stage_limit``: each stage copy keeps 1F1B's limit on live micro-batches (without it only the
    worker's cap bounds them, as a V's stages need: their depth is not a worker's)."""

    split: bool = False
    duration: Callable[[Action], float] | None = None
    reserve: bool = False
    patience: float = 0.0
    stage_limit: bool = True


def list_schedule(shape: Shape, costs: CostModel, rule: Rule = deepest_first,
                  cap: float | None = None, greed: Greed = Greed()) -> list[list[Action]] | None:
    """Per-worker orders from a greedy simulation (non-delay unless ``greed.patience``); None if the
    memory cap starves it.

    Each (pipeline, stage) keeps 1F1B's discipline: at most (D - stage) of its micro-batches
    alive. ``cap`` bounds a worker's total live activations (in M_a units)."""
    return _ListScheduler(shape, costs, rule, cap, greed).run()


class _ListScheduler:
    """The greedy simulation: which actions are ready on each worker (the dataflow rule decides), which
    run, and how many micro-batches each worker and stage holds."""

    def __init__(self, shape: Shape, costs: CostModel, rule: Rule, cap: float | None, greed: Greed):
        self.shape, self.rule, self.cap, self.greed = shape, rule, cap, greed
        self.probe = shape.empty("list")
        self.duration = greed.duration or (lambda a: costs.compute_time(self.probe, a))
        self.last = shape.depth * shape.virtual_stages - 1
        self.transfer = costs.transfer_time(self.probe)
        self.inputs: dict[int, list[int]] = {}  # pipeline -> its micro-batches in the order they enter
        for m, p in enumerate(shape.mb_pipeline):
            self.inputs.setdefault(p, []).append(m)
        ops = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if greed.split else (Op.FORWARD, Op.BACKWARD)
        self.consumers: dict[tuple, list[Action]] = {}
        self.copies: list[set] = [set() for _ in range(shape.depth)]  # stage copies (pipeline, stage) per worker
        self.forwards_left: dict[tuple[int, int], int] = {}
        for m, p in enumerate(shape.mb_pipeline):
            for s in range(self.last + 1):
                self.copies[shape.placement[p][s]].add((p, s))
                self.forwards_left[(p, s)] = self.forwards_left.get((p, s), 0) + 1
                for a in (Action(op, m, p, s) for op in ops):
                    for key in dependencies(a, self.last):
                        self.consumers.setdefault(key, []).append(a)
        self.done: dict[tuple, tuple[int, float]] = {}  # result -> (worker, end)
        self.ready: list[dict[Action, float]] = [dict() for _ in range(shape.depth)]  # action -> inputs here
        self.free, self.live = [0.0] * shape.depth, [0.0] * shape.depth
        self.stage_live: dict[tuple[int, int], int] = {}
        self.orders: list[list[Action]] = [[] for _ in range(shape.depth)]
        self.running: list[tuple[float, int, Action]] = []  # (end, worker, action)

    def run(self) -> list[list[Action]] | None:
        for p in self.inputs:
            self._offer(F(self.inputs[p].pop(0), p, 0), 0.0)
        passes = 3 if self.greed.split else 2
        remaining, now = passes * self.shape.microbatches * (self.last + 1), 0.0
        while remaining:
            for w in range(self.shape.depth):
                if self.free[w] <= now:
                    self._start_first(w, now)
            upcoming = [end for end, _, _ in self.running] + \
                [t for r in self.ready for t in r.values() if t > now]
            if not upcoming:
                return None  # nothing runs and nothing arrives: the cap starves the pipeline
            now = min(upcoming)
            for end, w, a in [r for r in self.running if r[0] <= now]:
                remaining -= 1
                self._finish(w, a, end)
            self.running = [r for r in self.running if r[0] > now]
        return self.orders

    def _offer(self, action: Action, at: float) -> None:
        self.ready[self.shape.placement[action.pipeline][action.stage]][action] = at

    def _allowed(self, w: int, a: Action) -> bool:
        """A backward pass always; a forward within its stage's 1F1B limit and the worker's cap, less the
        slots reserved for the worker's other stage copies (``Greed.reserve``)."""
        copy = (a.pipeline, a.stage)
        if a.op is not Op.FORWARD:
            return True
        if self.greed.stage_limit and \
                self.stage_live.get(copy, 0) >= self.shape.depth - a.stage // self.shape.virtual_stages:
            return False
        if self.cap is None:
            return True
        reserved = sum(self.stage_live.get(c, 0) == 0 and self.forwards_left[c] > 0
                       for c in self.copies[w] if c != copy) if self.greed.reserve else 0
        return self.live[w] + activation_units(self.probe, a) <= self.cap - reserved + 1e-9

    def _start_first(self, w: int, now: float) -> None:
        """Start the ready action the rule ranks first, if any, unless a higher-ranked one arrives soon
        (``Greed.patience``); a stage-0 forward lets the next input in."""
        options = [(a, t) for a, t in self.ready[w].items() if t <= now and self._allowed(w, a)]
        if not options:
            return
        a, t = min(options, key=lambda o: self.rule(o[0], o[1]))
        horizon = now + self.greed.patience * self.duration(a)
        if any(now < u < horizon and self.rule(b, u) < self.rule(a, t) and self._allowed(w, b)
               for b, u in self.ready[w].items()):
            return
        del self.ready[w][a]
        end = now + self.duration(a)
        self.free[w] = end
        self.orders[w].append(a)
        sign = {Op.FORWARD: 1, Op.BACKWARD: -1, Op.BACKWARD_WEIGHT: -1}.get(a.op, 0)
        self.live[w] += activation_units(self.probe, a) * sign
        self.stage_live[(a.pipeline, a.stage)] = self.stage_live.get((a.pipeline, a.stage), 0) + sign
        if a.op is Op.FORWARD:
            self.forwards_left[(a.pipeline, a.stage)] -= 1
        self.running.append((end, w, a))
        if a.op.value == "F" and a.stage == 0 and self.inputs[a.pipeline]:
            self._offer(F(self.inputs[a.pipeline].pop(0), a.pipeline, 0), 0.0)

    def _finish(self, w: int, a: Action, end: float) -> None:
        """Record what ``a`` made, and offer each action whose inputs are now all made, when they reach
        its worker."""
        for key in products(a):
            self.done[key] = (w, end)
            for consumer in self.consumers.get(key, ()):
                deps = dependencies(consumer, self.last)
                if all(d in self.done for d in deps):
                    here = self.shape.placement[consumer.pipeline][consumer.stage]
                    self._offer(consumer, max(t + (self.transfer if src != here else 0.0)
                                              for src, t in (self.done[d] for d in deps)))
