"""Time-weighted replay of a schedule: makespan, bubbles, activation and weight memory.

Every worker runs its list in order; an action starts when the worker is free and its inputs have
arrived (p2p: latency + bytes / bandwidth, free on the same worker). Sends never block, as in the
executor, so the only way to get stuck is a real dependency cycle, which ``replay`` reports.
A gradient reduction (R) is posted without blocking; the collective of a stage starts once every
copy has posted it and the workers' collective channels are free, and an iteration ends when the
last compute and the last reduction are done (the flush).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .errors import InvalidSchedule
from .ir import Action, Op, Schedule


@dataclass(frozen=True)
class CostModel:
    """Costs in arbitrary time units. ``forward``/``backward`` are the times of one full micro-batch
    through 1/D of the model (one 1F1B stage), or one value per model stage. An interleaved chunk
    costs a 1/v share of that; a half-size micro-batch half of it. A split backward runs the same
    ``backward`` as two passes: W (``weight``, the weight gradients; default half the backward) and I
    (the rest, the input gradient).

    All-reduce: Rabenseifner, 2 log2(r) alpha + 2 (r-1)/r beta L, over r = copies x data_parallel,
    with L = ``grad_bytes`` of one 1F1B stage and beta = 1 / ``allreduce_bandwidth``.
    ``collectives_use_compute``: an all-reduce occupies the worker's compute while it runs, as gloo's
    host-side reduction does when each rank has one core (lowered schedules only); on a GPU, NCCL's
    collectives overlap compute."""

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    p2p_latency: float = 0.0
    p2p_bandwidth: float = math.inf
    activation_bytes: float = 0.0
    allreduce_latency: float = 0.0
    allreduce_bandwidth: float = math.inf
    grad_bytes: float = 0.0
    data_parallel: int = 1
    collectives_use_compute: bool = False
    weight: float | Sequence[float] | None = None

    def compute_time(self, schedule: Schedule, action: Action) -> float:
        if action.op is Op.FORWARD:
            t = self._per_stage(self.forward, schedule, action)
        elif action.op is Op.BACKWARD:
            t = self._per_stage(self.backward, schedule, action)
        else:
            t = self.weight_time(schedule, action)
            if action.op is Op.BACKWARD_INPUT:
                t = self._per_stage(self.backward, schedule, action) - t
        return t * schedule.microbatch_scale

    def weight_time(self, schedule: Schedule, action: Action) -> float:
        """The W part of one full-size backward of the action's stage."""
        if self.weight is None:
            return self._per_stage(self.backward, schedule, action) / 2
        return self._per_stage(self.weight, schedule, action)

    @staticmethod
    def _per_stage(value, schedule: Schedule, action: Action) -> float:
        if isinstance(value, (int, float)):
            return value / schedule.chunks
        return value[action.stage]

    def transfer_time(self, schedule: Schedule) -> float:
        return self.p2p_latency + self.activation_bytes * schedule.microbatch_scale / self.p2p_bandwidth

    def allreduce_time(self, schedule: Schedule, copies: int) -> float:
        r = copies * self.data_parallel
        if r <= 1:
            return 0.0
        volume = self.grad_bytes / schedule.chunks
        return 2 * math.log2(r) * self.allreduce_latency + 2 * (r - 1) / r * volume / self.allreduce_bandwidth


@dataclass(frozen=True)
class Event:
    worker: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    schedule: Schedule
    events: list[Event]
    reductions: list[Event]
    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_ratio: float
    peak_activations: list[float]
    stage_copies: list[int]
    weight_units: list[float]
    transfers: list[Event] = field(default_factory=list)  # p2p transfers of a lowered schedule

    def stats(self) -> dict:
        s = self.schedule
        return {
            "schedule": s.name,
            "stages": s.stages,
            "microbatches": s.microbatches,
            "pipelines": s.pipelines,
            "chunks": s.chunks,
            "makespan": _num(self.makespan),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "busy": [_num(b) for b in self.busy],
            "idle": [_num(i) for i in self.idle],
            "peak_activations": [_num(p) for p in self.peak_activations],
            "stage_copies": self.stage_copies,
            "weight_units": [_num(w) for w in self.weight_units],
        }


def _num(x: float):
    """Integral floats print as ints: makespan 16, not 16.0."""
    return int(round(x)) if abs(x - round(x)) < 1e-9 else round(x, 6)


@dataclass
class _Replay:
    events: list[Event] = field(default_factory=list)
    posts: dict[int, list[tuple[float, int, Action]]] = field(default_factory=dict)
    free: list[float] = field(default_factory=list)


def dependencies(action: Action, last_stage: int) -> list[tuple[str, int, int, int]]:
    """Keys of the results an action consumes. Keys: ("F"|"G"|"I", pipeline, stage, mb), where G is
    the input gradient a B or I sends upstream and I the local input-grad pass a W follows."""
    p, s, m = action.pipeline, action.stage, action.mb
    if action.op is Op.FORWARD:
        return [("F", p, s - 1, m)] if s > 0 else []
    if action.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
        deps = [("F", p, s, m)]
        return deps + ([("G", p, s + 1, m)] if s < last_stage else [])
    if action.op is Op.BACKWARD_WEIGHT:
        return [("I", p, s, m)]
    return []


def products(action: Action) -> list[tuple[str, int, int, int]]:
    p, s, m = action.pipeline, action.stage, action.mb
    return {
        Op.FORWARD: [("F", p, s, m)],
        Op.BACKWARD: [("G", p, s, m)],
        Op.BACKWARD_INPUT: [("G", p, s, m), ("I", p, s, m)],
        Op.BACKWARD_WEIGHT: [],
        Op.REDUCE_GRADS: [],
    }[action.op]


def replay(schedule: Schedule, costs: CostModel) -> _Replay:
    """Run every worker's list in order under ``costs``; raise InvalidSchedule naming the wait-for
    cycle if no worker can make progress."""
    last = schedule.stages_per_pipeline - 1
    transfer = costs.transfer_time(schedule)
    done: dict[tuple, tuple[int, float]] = {}
    pos = [0] * schedule.num_workers
    out = _Replay(free=[0.0] * schedule.num_workers)
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
                    ready = max([done[d][1] + (transfer if done[d][0] != w else 0.0) for d in deps], default=0.0)
                    start = max(out.free[w], ready)
                    end = start + costs.compute_time(schedule, a)
                    out.events.append(Event(w, a, start, end))
                    out.free[w] = end
                    for key in products(a):
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
            return InvalidSchedule(f"waits for {_key_str(missing)}, which no worker produces", w, head)
        chain.append((w, head, missing))
        w = producer[missing][0]
    start = [c[0] for c in chain].index(w)
    cycle = " -> ".join(f"worker {cw} at {h} waits for {_key_str(k)}" for cw, h, k in chain[start:])
    first_w, first_a, _ = chain[start]
    return InvalidSchedule(f"deadlock: cross-worker cycle: {cycle}", first_w, first_a)


def _key_str(key: tuple) -> str:
    kind, p, s, m = key
    name = {"F": "forward", "G": "input gradient", "I": "input-grad pass"}[kind]
    return f"{name} of micro-batch {m}, pipeline {p}, stage {s}"


def _reduce_windows(schedule: Schedule, costs: CostModel, posts: dict) -> list[Event]:
    """Collectives in order of readiness; a worker's collectives run one after another."""
    channel = [0.0] * schedule.num_workers
    windows = []
    groups = sorted(posts.items(), key=lambda kv: max(t for t, _, _ in kv[1]))
    for stage, members in groups:
        ready = max(t for t, _, _ in members)
        start = max([ready] + [channel[w] for _, w, _ in members])
        end = start + costs.allreduce_time(schedule, len(members))
        for _, w, a in members:
            channel[w] = end
            windows.append(Event(w, a, start, end))
    return windows


def activation_units(schedule: Schedule, action: Action) -> float:
    """Activation memory of one action's micro-batch in one model stage, in units of one full
    micro-batch through one 1F1B stage (M_a in the paper)."""
    return schedule.microbatch_scale / schedule.chunks


def peak_activations(schedule: Schedule) -> list[float]:
    """Per worker, the most micro-batch activations alive at once: allocated by F, freed by B, or with
    a split backward by W, not I (the executor keeps the micro-batch's autograd graph, and with it every
    saved activation, from I until W; the weight gradients need the layer inputs, and torch cannot free
    the rest of a graph it still has to run)."""
    peaks = []
    for w in range(schedule.num_workers):
        live = peak = 0.0
        for a in schedule.workers[w]:
            if a.op is Op.FORWARD:
                live += activation_units(schedule, a)
                peak = max(peak, live)
            elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                live -= activation_units(schedule, a)
        peaks.append(peak)
    return peaks


def simulate(schedule: Schedule, costs: CostModel | None = None, comm: str = "nccl") -> SimResult:
    """Replay under ``costs``. A lowered schedule is replayed operation by operation under the rules
    of ``comm`` (nccl_model.py): a transfer starts when both ends have posted it and their streams are
    free, so what the posting order overlaps is priced. A compute schedule charges each message a fixed
    delay and runs reductions when every copy is ready."""
    costs = costs or CostModel()
    if schedule.lowered:
        from .nccl_model import run_lowered

        run = run_lowered(schedule, comm, costs)
        events, reductions, transfers, finish = run.events, run.reductions, run.transfers, run.finish
    else:
        plain = replay(schedule, costs)
        events, reductions, transfers = plain.events, _reduce_windows(schedule, costs, plain.posts), []
        finish = list(plain.free)
        for e in reductions:
            finish[e.worker] = max(finish[e.worker], e.end)
    makespan = max(finish, default=0.0)
    busy = [0.0] * schedule.num_workers
    for e in events:
        busy[e.worker] += e.end - e.start
    idle = [makespan - b for b in busy]
    workers = schedule.num_workers
    copies = [len(schedule.held(w)) for w in range(workers)]
    return SimResult(
        schedule=schedule,
        events=sorted(events, key=lambda e: (e.worker, e.start)),
        reductions=reductions,
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=sum(idle) / (makespan * workers) if makespan > 0 else 0.0,
        peak_activations=peak_activations(schedule),
        stage_copies=copies,
        weight_units=[c / schedule.chunks for c in copies],
        transfers=sorted(transfers, key=lambda e: (e.worker, e.start)),
    )

