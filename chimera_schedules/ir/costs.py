"""Costs: what an action, a message and a reduction take, in the units a CostModel is given in. The
simulator, the list scheduler, the search and the split-backward pass price actions with these."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .actions import Action, Op
from .schedule import Schedule


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
            return value / schedule.virtual_stages
        return value[action.stage]

    def transfer_time(self, schedule: Schedule) -> float:
        return self.p2p_latency + self.activation_bytes * schedule.microbatch_scale / self.p2p_bandwidth

    def allreduce_time(self, schedule: Schedule, copies: int) -> float:
        r = copies * self.data_parallel
        if r <= 1:
            return 0.0
        volume = self.grad_bytes / schedule.virtual_stages
        return 2 * math.log2(r) * self.allreduce_latency + 2 * (r - 1) / r * volume / self.allreduce_bandwidth


@dataclass(frozen=True)
class Event:
    worker: int
    action: Action
    start: float
    end: float


def activation_units(schedule: Schedule, action: Action) -> float:
    """Activation memory of one action's micro-batch in one model stage, in units of one full
    micro-batch through one 1F1B stage (M_a in the paper)."""
    return schedule.microbatch_scale / schedule.virtual_stages
