"""What each emulated stage costs, and what the simulator predicts for a case at those costs.

The times are the planner's for GPT-2 1.3B (64 layers, hidden 1280, sequence 632, micro-batch 1) on a
profile (Piz Daint's P100 by default): a model stage's forward from Megatron's FLOP count, the last
stage's with the logits; backward = 2 x forward, and a split backward's W = F (so I = F). They are
scaled so that the median forward of a 1F1B stage at this depth is ``forward_ms``: every schedule at
one depth runs the same stages, and at every depth a forward is a few tens of milliseconds.
"""
from __future__ import annotations

import os
import statistics

from chimera_schedules import CostModel, Schedule, simulate
from chimera_schedules.ir.actions import Action, Op
from chimera_schedules.passes.lowering import lower
from chimera_schedules.tools.planner import GPT2_1_3B, Profile, costs

from .stage import StageTimes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILE = os.path.join(ROOT, "profiles", "piz-daint-p100.json")


def stage_times(depth: int, virtual_stages: int, forward_ms: float, profile: str = PROFILE) -> list[StageTimes]:
    """Per model stage (depth x virtual_stages of them), seconds of F, I and W."""
    p = Profile.load(profile)
    scale = forward_ms / 1e3 / statistics.median(costs(GPT2_1_3B, p, depth, 1, 1).forward)
    forward = costs(GPT2_1_3B, p, depth, 1, 1, virtual_stages=virtual_stages).forward
    return [StageTimes(f * scale, f * scale, f * scale) for f in forward]


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
