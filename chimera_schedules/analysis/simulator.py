"""Time-weighted replay of a schedule: makespan, bubbles, activation and weight memory.

``simulate`` is the one place in the library that tells a lowered schedule from a compute one. A
compute schedule is replayed by ``replay.py`` (each message a fixed delay: latency + bytes / bandwidth,
free on the same worker); a lowered one under NCCL's rules by ``nccl_model.py``. A gradient reduction
(R) is posted without blocking; the collective of a stage starts once every copy has posted it and the
workers' collective channels are free, and an iteration ends when the last compute and the last
reduction are done (the flush).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..ir.actions import Op, parts
from ..ir.costs import CostModel, Event, activation_units
from ..ir.schedule import Schedule
from .nccl_model import run_lowered
from .replay import replay


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
            "stages": s.depth,
            "microbatches": s.microbatches,
            "pipelines": s.pipelines,
            "chunks": s.virtual_stages,
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


def reduce_windows(schedule: Schedule, costs: CostModel, posts: dict) -> list[Event]:
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


def peak_activations(schedule: Schedule, stage_bytes: Sequence[float] | None = None,
                     kept_for_w: Sequence[float] | None = None) -> list[float]:
    """Per worker, the most micro-batch activations alive at once: allocated by F, freed by B, or with
    a split backward by W, not I (the executor keeps the micro-batch's autograd graph, and with it every
    saved activation, from I until W; the weight gradients need the layer inputs, and torch cannot free
    the rest of a graph it still has to run). In units of M_a (``activation_units``), or in bytes when
    ``stage_bytes[s]`` gives what one of the schedule's micro-batches keeps in model stage s. I also
    keeps, until W, the gradient arriving at each weight's operation: ``kept_for_w[s]`` bytes of it per
    micro-batch in stage s (not counted when not given). An overlapped action counts as its forward then
    its backward: the forward's activations are allocated before the backward frees any."""
    def size(a) -> float:
        return activation_units(schedule, a) if stage_bytes is None else stage_bytes[a.stage]

    def kept(a) -> float:
        return 0.0 if kept_for_w is None else kept_for_w[a.stage]

    grows = {Op.FORWARD: size, Op.BACKWARD_INPUT: kept}
    shrinks = {Op.BACKWARD: size, Op.BACKWARD_WEIGHT: lambda a: size(a) + kept(a)}
    peaks = []
    for w in range(schedule.num_workers):
        live = peak = 0.0
        for a in (p for action in schedule.workers[w] for p in parts(action)):
            if a.op in grows:
                live += grows[a.op](a)
                peak = max(peak, live)
            elif a.op in shrinks:
                live -= shrinks[a.op](a)
        peaks.append(peak)
    return peaks


def simulate(schedule: Schedule, costs: CostModel | None = None, comm: str = "nccl") -> SimResult:
    """Replay under ``costs``. A lowered schedule is replayed operation by operation under the rules
    of ``comm`` (nccl_model.py): a transfer starts when both ends have posted it and their streams are
    free, so what the posting order overlaps is priced. A compute schedule charges each message a fixed
    delay and runs reductions when every copy is ready."""
    costs = costs or CostModel()
    if schedule.lowered:
        run = run_lowered(schedule, comm, costs)
        events, reductions, transfers, finish = run.events, run.reductions, run.transfers, run.finish
    else:
        plain = replay(schedule, costs)
        events, reductions, transfers = plain.events, reduce_windows(schedule, costs, plain.posts), []
        finish = list(plain.free)
        for e in reductions:
            finish[e.worker] = max(finish[e.worker], e.end)
    return timeline_result(schedule, events, max(finish, default=0.0), peak_activations(schedule), reductions,
                           transfers)


def timeline_result(schedule: Schedule, events: list[Event], makespan: float, peaks: list[float],
                    reductions: list[Event] = (), transfers: list[Event] = ()) -> SimResult:
    """Bubbles and memory of a timeline, predicted or measured: a worker's idle time is the iteration's
    span less its compute, waiting for peers and communication included."""
    workers = schedule.num_workers
    busy = [0.0] * workers
    for e in events:
        busy[e.worker] += e.end - e.start
    idle = [makespan - b for b in busy]
    copies = [len(schedule.held(w)) for w in range(workers)]
    return SimResult(
        schedule=schedule,
        events=sorted(events, key=lambda e: (e.worker, e.start)),
        reductions=list(reductions),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=sum(idle) / (makespan * workers) if makespan > 0 else 0.0,
        peak_activations=peaks,
        stage_copies=copies,
        weight_units=[c / schedule.virtual_stages for c in copies],
        transfers=sorted(transfers, key=lambda e: (e.worker, e.start)),
    )

