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
    it costs F + B. A halved action (``Halved``) runs its pass as two halves of its micro-batch the same
    way (``parts.halves``), each half's compute half the whole's divided by ``halves_efficiency``: the
    efficiency of the split the run halves along (``halves_efficiency_at``).
    ``contention``: how much slower compute runs while an all-to-all is in flight beside it (0: not at
    all; 0.15: 15% slower), in overlapped and halved actions (``parts.timeline``).

    Host: ``host`` is what issuing one piece of work adds to it, measured (a kernel launch and its
    hand-off on a GPU; on the depth benchmark's emulated device a timed wait's late wake-up and a
    thread's hand-off, which it measures at startup): each part of a pass through MoE layers, each of a
    plain stage's passes (a whole backward is two: I and W). Default 0."""

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
    halves_efficiency: float = 1.0
    contention: float = 0.0
    host: float = 0.0

    def compute_time(self, schedule: Schedule, action: Action | Overlapped) -> float:
        """How long the action holds its worker: compute and all-to-all one after the other when alone,
        interleaved when overlapped; scaled by the schedule's micro-batch size."""
        if action.op is Op.OVERLAPPED:
            return self._overlapped_time(schedule, action) * schedule.microbatch_scale
        scale = schedule.microbatch_scale
        if action.op is Op.HALVED:
            return moe.span(moe.halves(self._parts(schedule, action.action), self.halves_efficiency),
                            self.contention, self.host / scale) * scale
        compute, a2a = self._alone(schedule, action)
        return (compute + a2a) * scale + self.host * self._issued(schedule, action)

    def _issued(self, schedule: Schedule, action: Action) -> int:
        """How many pieces of work a plain action issues: its parts that take time through MoE layers,
        else one per pass (a whole backward two: its I and its W); a W one."""
        if action.op is Op.BACKWARD_WEIGHT or not self.host:
            return 1
        if has_a2a(self):
            return sum(part.time > 0 for part in self._parts(schedule, action))
        return 2 if action.op is Op.BACKWARD else 1

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
        return max(self.overlapped_ends(schedule, action, 0.0, 0.0)) / schedule.microbatch_scale

    def overlapped_ends(self, schedule: Schedule, action: Overlapped, f_ready: float, b_ready: float
                        ) -> tuple[float, float]:
        """When an overlapped action's forward and backward end, from the moment it starts, if the
        forward's input is there at ``f_ready`` and the backward's at ``b_ready`` after that: each part
        waits for its own micro-batch's input only (a pair need not wait for both to begin)."""
        forward, backward = action.parts
        order = moe.interleave(self._parts(schedule, forward), self._parts(schedule, backward))
        scale = schedule.microbatch_scale
        events = moe.timeline(order, self.contention, {"F": f_ready / scale, "B": b_ready / scale}, self.host / scale)
        ends = {role: max((end for part, _, end in events if part.role == role), default=0.0) for role in "FB"}
        return ends["F"] * scale, ends["B"] * scale

    def run_times(self, schedule: Schedule, action: Action | Overlapped, free: float,
                  ready: Sequence[float]) -> tuple[float, list[float]]:
        """When an action on a worker free at ``free`` starts, and when each of its parts' results are
        there, given when each part's inputs are (``ready``, one per part). An overlapped action starts
        once either part's input is there and each part waits only for its own (``overlapped_ends``);
        any other starts once all are there."""
        if action.op is not Op.OVERLAPPED:
            start = max([free, *ready])
            return start, [start + self.compute_time(schedule, action)] * len(ready)
        start = max(free, min(ready))
        ends = self.overlapped_ends(schedule, action, *(max(0.0, r - start) for r in ready))
        return start, [start + end for end in ends]

    def part_order(self, schedule: Schedule, action: Action | Overlapped) -> list[moe.Part]:
        """The parts an action issues, in order, at full micro-batch size (what ``compute_time`` prices;
        the renderers draw them): a pair interleaved, a halved action's two halves, a W one compute part."""
        if action.op is Op.OVERLAPPED:
            return moe.interleave(*(self._parts(schedule, part) for part in action.parts))
        if action.op is Op.HALVED:
            return moe.halves(self._parts(schedule, action.action), self.halves_efficiency)
        if action.op is Op.BACKWARD_WEIGHT:
            return [moe.Part("B", 0, "experts", self.weight_time(schedule, action))]
        return self._parts(schedule, action)

    def _parts(self, schedule: Schedule, action: Action) -> list[moe.Part]:
        """A plain F, B or I of one full-size micro-batch as the parts of its MoE layers."""
        compute, a2a = self._alone(schedule, action)
        make = moe.forward_parts if action.op is Op.FORWARD else moe.backward_parts
        return make(compute, a2a, self._layers(action), self.attention_share)

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


def has_a2a(costs: CostModel) -> bool:
    """Whether any stage spends time in an all-to-all (its passes then run as parts)."""
    return any(costs.a2a) if not isinstance(costs.a2a, (int, float)) else costs.a2a != 0


def halves_efficiency_at(micro_batch_size: int | None, batch: float = 1.0, sequence: float = 1.0) -> float:
    """A halved action's efficiency at this micro-batch size: an even size runs as two halves of its
    sequences, at ``batch``'s; an odd one (1 most often) as the first and second half of each sequence
    (runtime/stage.py's SEQUENCE), at ``sequence``'s. None: the batch split. The trainer halves the same way
    (megatron/chimera/config/schedule_request.py's ``halves_split``)."""
    return batch if micro_batch_size is None or micro_batch_size % 2 == 0 else sequence
