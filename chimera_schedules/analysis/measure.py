"""Measured timelines in the simulator's terms: per-action timestamps from real ranks become a
``SimResult``, so bubbles, memory and pictures are computed and drawn the same way for a measured run
as for a predicted one."""
from __future__ import annotations

from ..ir.actions import Op, parts
from ..ir.costs import Event
from ..ir.schedule import Schedule
from .simulator import SimResult, timeline_result


def measured_result(schedule: Schedule, events: list[Event], makespan: float,
                    activation_bytes: dict[tuple[int, int, int], int] | None = None) -> SimResult:
    """``events``: the compute actions of one iteration on every worker, with times relative to the
    iteration's start; ``makespan``: the iteration's span. Bubbles are what is not compute, waiting for
    peers included. ``activation_bytes[(pipeline, stage, mb)]``: bytes each forward kept for its
    backward; peaks are then in bytes, following each worker's order of events (a micro-batch's bytes
    are freed by its B, or by its W when the backward is split; an overlapped action's forward counts
    before its backward)."""
    peaks = [0.0] * schedule.num_workers
    if activation_bytes is not None:
        for w in range(schedule.num_workers):
            live = 0.0
            for e in sorted((e for e in events if e.worker == w), key=lambda e: e.start):
                for a in parts(e.action):
                    sign = {Op.FORWARD: 1, Op.BACKWARD: -1, Op.BACKWARD_WEIGHT: -1}.get(a.op, 0)
                    live += activation_bytes.get((a.pipeline, a.stage, a.mb), 0) * sign
                    peaks[w] = max(peaks[w], live)
    return timeline_result(schedule, events, makespan, peaks)
