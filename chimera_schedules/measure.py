"""Measured timelines in the simulator's terms: per-action timestamps from real ranks become a
``SimResult``, so bubbles, memory and pictures are computed and drawn the same way for a measured run
as for a predicted one."""
from __future__ import annotations

from .ir import Op, Schedule
from .simulator import Event, SimResult


def measured_result(schedule: Schedule, events: list[Event], makespan: float,
                    activation_bytes: dict[tuple[int, int, int], int] | None = None) -> SimResult:
    """``events``: the compute actions of one iteration on every worker, with times relative to the
    iteration's start; ``makespan``: the iteration's span. Bubbles are what is not compute, waiting for
    peers included. ``activation_bytes[(pipeline, stage, mb)]``: bytes each forward kept for its
    backward; peaks are then in bytes, following each worker's order of events (a micro-batch's bytes
    are freed by its B, or by its W when the backward is split)."""
    workers = schedule.num_workers
    busy = [0.0] * workers
    for e in events:
        busy[e.worker] += e.end - e.start
    idle = [makespan - b for b in busy]
    peaks = [0.0] * workers
    if activation_bytes is not None:
        for w in range(workers):
            live = 0.0
            for e in sorted((e for e in events if e.worker == w), key=lambda e: e.start):
                key = (e.action.pipeline, e.action.stage, e.action.mb)
                sign = {Op.FORWARD: 1, Op.BACKWARD: -1, Op.BACKWARD_WEIGHT: -1}.get(e.action.op, 0)
                live += activation_bytes.get(key, 0) * sign
                peaks[w] = max(peaks[w], live)
    copies = [len(schedule.held(w)) for w in range(workers)]
    return SimResult(schedule=schedule, events=sorted(events, key=lambda e: (e.worker, e.start)), reductions=[],
                     makespan=makespan, busy=busy, idle=idle,
                     bubble_ratio=sum(idle) / (makespan * workers) if makespan > 0 else 0.0,
                     peak_activations=peaks, stage_copies=copies, weight_units=[c / schedule.chunks for c in copies])
