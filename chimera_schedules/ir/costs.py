"""Costs: what an action, a message and a reduction take, in the units a CostModel is given in. The
simulator, the list scheduler, the search and the split-backward pass price actions with these."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from . import parts as moe
from .actions import Action, Op, Overlapped
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
    collectives overlap compute.

    Expert all-to-all: ``a2a`` (one value, or one per model stage like ``forward``) is what one
    micro-batch's forward through the stage's MoE layers spends in all-to-alls, dispatch and combine of
    all its layers together; a B or an I moves the same tokens back and spends it too, a W none. Alone,
    an action's time is its compute plus its ``a2a``. An overlapped F&B runs both as megatron-core's
    combined 1F1B does (``ir/parts.py``): ``moe_layers`` layers (one count for every model stage, or one
    per model stage) share the stage's compute and all-to-all, ``attention_share`` of a layer's compute
    is its attention, so one micro-batch's all-to-alls hide behind the other's compute. With ``a2a`` = 0
    it costs F + B."""

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
    a2a: float | Sequence[float] = 0.0
    moe_layers: int | Sequence[int] = 1
    attention_share: float = 0.5

    def compute_time(self, schedule: Schedule, action: Action | Overlapped) -> float:
        """How long the action holds its worker: compute and all-to-all one after the other when alone,
        interleaved when overlapped; scaled by the schedule's micro-batch size."""
        if action.op is Op.OVERLAPPED:
            return self._overlapped_time(schedule, action) * schedule.microbatch_scale
        compute, a2a = self._alone(schedule, action)
        return (compute + a2a) * schedule.microbatch_scale

    def _alone(self, schedule: Schedule, action: Action) -> tuple[float, float]:
        """(compute, all-to-all) of one full-size plain compute action."""
        if action.op is Op.BACKWARD_WEIGHT:
            return self.weight_time(schedule, action), 0.0
        a2a = self._per_stage(self.a2a, schedule, action)
        if action.op is Op.FORWARD:
            return self._per_stage(self.forward, schedule, action), a2a
        if action.op is Op.BACKWARD:
            return self._per_stage(self.backward, schedule, action), a2a
        if action.op is Op.BACKWARD_INPUT:
            return self._per_stage(self.backward, schedule, action) - self.weight_time(schedule, action), a2a
        raise ValueError(f"{action} is not a compute action")

    def _overlapped_time(self, schedule: Schedule, action: Overlapped) -> float:
        """One full-size overlapped action: its parts interleaved layer by layer (``ir/parts.py``)."""
        forward, backward = action.parts
        f_compute, f_a2a = self._alone(schedule, forward)
        b_compute, b_a2a = self._alone(schedule, backward)
        f_parts = moe.forward_parts(f_compute, f_a2a, self._layers(forward), self.attention_share)
        b_parts = moe.backward_parts(b_compute, b_a2a, self._layers(backward), self.attention_share)
        return moe.span(moe.interleave(f_parts, b_parts))

    def _layers(self, action: Action) -> int:
        return self.moe_layers if isinstance(self.moe_layers, int) else self.moe_layers[action.stage]

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
