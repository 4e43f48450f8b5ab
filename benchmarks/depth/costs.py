"""What each emulated stage costs, what one message should cost, and what the simulator predicts for a
case at those costs.

The times are the planner's for the chosen model (``planner.MODELS``: GPT-2 1.3B, Llama 3 8B,
DeepSeek-V3; micro-batch 1) on a profile (Piz Daint's P100 for GPT-2 1.3B, the paper's machine; an
H100 for the others, the machine they are trained on): a model stage's forward from Megatron's FLOP
count for the layers the layout gives it, with the logits (and MTP) on the last stage; backward = 2 x
forward, and a split backward's W = F (so I = F). One scale per model and depth makes the median
forward of the even split's 1F1B stages ``forward_ms``, whatever the layout or schedule: every case
of one launch runs on the same clock, so an uneven layout's slower stages really are slower.
"""
from __future__ import annotations

import os
import statistics

from chimera_schedules import CostModel, Schedule, simulate
from chimera_schedules.ir.actions import Action, Op
from chimera_schedules.ir.layout import Layout
from chimera_schedules.passes.lowering import lower
from chimera_schedules.tools.planner import ModelShape, Profile, costs

from .stage import StageTimes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILES = {"gpt2-1.3b": "piz-daint-p100.json", "llama3-8b": "h100-datasheet.json",
            "deepseek-v3": "h100-datasheet.json"}  # each model's default profile, in profiles/


def default_profile(model: str) -> str:
    return os.path.join(ROOT, "profiles", PROFILES[model])


def unscaled_forward(shape: ModelShape, profile: Profile, depth: int) -> float:
    """Seconds of the median forward of the even split's 1F1B stages on the profile: the clock's unit."""
    return statistics.median(costs(shape, profile, depth, 1, 1).forward)


def stage_times(shape: ModelShape, depth: int, virtual_stages: int, forward_ms: float, profile: Profile,
                held: Layout | None = None) -> list[StageTimes]:
    """Per model stage (depth x virtual_stages of them, split as ``held`` says, evenly by default),
    seconds of F, I and W."""
    scale = forward_ms / 1e3 / unscaled_forward(shape, profile, depth)
    forward = costs(shape, profile, depth, 1, 1, virtual_stages=virtual_stages, held=held).forward
    return [StageTimes(f * scale, f * scale, f * scale) for f in forward]


def message_target_ms(shape: ModelShape, profile: Profile, depth: int, forward_ms: float) -> float:
    """What one activation between neighbours should cost on the emulated clock: the profile's p2p time
    of one (latency + s h x 2 bytes / bandwidth) as the same share of the median 1F1B stage forward
    that it is on the profile."""
    p2p = profile.p2p_latency + shape.seq * shape.hidden * 2 / profile.p2p_bandwidth
    return forward_ms * p2p / unscaled_forward(shape, profile, depth)


def cost_model(times: list[StageTimes], p2p_ms: float, first_input_in_weight: bool = False) -> CostModel:
    """The simulator's costs in milliseconds. ``first_input_in_weight``: the runtime does a first
    stage's whole backward in its W and nothing in its I (torch.distributed.pipelining does: its
    first stage has no input gradient to send)."""
    forward = [t.forward * 1e3 for t in times]
    backward = [(t.input + t.weight) * 1e3 for t in times]
    weight = [t.weight * 1e3 for t in times]
    if first_input_in_weight:
        weight[0] = backward[0]
    return CostModel(forward=forward, backward=backward, weight=weight, p2p_latency=p2p_ms)


def predict(schedule: Schedule, model: CostModel, lowered: bool) -> dict:
    """Makespan (ms), bubble ratio and memory of a schedule at these costs. A lowered schedule (what our
    executor posts) is replayed under gloo's rules; another runtime's order, of which only the compute
    is known, with each message a fixed delay."""
    result = simulate(lower(schedule) if lowered else schedule, model, "gloo")
    return {"predicted_ms": result.makespan, "predicted_bubble": result.bubble_ratio,
            "peak_activations": max(result.peak_activations), "weight_copies": max(result.weight_units)}


_OPS = {"F": Op.FORWARD, "I": Op.BACKWARD_INPUT, "W": Op.BACKWARD_WEIGHT, "B": Op.BACKWARD}


def from_torch(name: str, depth: int, microbatches: int, placement: list[int], order: dict) -> Schedule:
    """A torch.distributed.pipelining schedule's compute order (``pipeline_order``: rank -> actions,
    None for an idle slot) as our IR, one pipeline whose stage s lives on ``placement[s]``. An
    overlapped forward-backward pair (DualPipeV's) runs its two halves one after the other, as torch
    does without a custom overlap function."""
    workers = []
    for rank in range(depth):
        actions = []
        for a in order[rank]:
            for part in (a.sub_actions or (a,)) if a is not None else ():
                actions.append(Action(_OPS[part.computation_type.value], part.microbatch_index, 0, part.stage_index))
        workers.append(tuple(actions))
    return Schedule(f"torch {name}", depth, microbatches, (tuple(placement),), tuple(workers),
                    virtual_stages=len(placement) // depth)
