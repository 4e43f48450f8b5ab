"""What each emulated stage costs, what one message should cost, and what the simulator predicts for a
case at those costs.

The times are the planner's for the chosen model (``planner.MODELS``: GPT-2 1.3B, Llama 3 8B,
DeepSeek-V3; micro-batch 1) on a profile (Piz Daint's P100 for GPT-2 1.3B, the paper's machine; an
H100 for the others, the machine they are trained on): a model stage's forward from Megatron's FLOP
count for the layers the layout gives it, with the logits (and MTP) on the last stage; backward = 2 x
forward, and a split backward's W = F (so I = F). One scale per model and depth makes the median
forward of the even split's 1F1B stages ``forward_ms``, whatever the layout or schedule: every case
of one launch runs on the same clock, so an uneven layout's slower stages really are slower.

With ``--a2a-fraction`` (a model with experts: DeepSeek-V3) each MoE layer of a stage spends that
fraction of its own forward compute in all-to-alls (dispatch and combine) in each forward, I and whole
backward (the W none): a stage's ``a2a`` is the fraction of its MoE layers' forward compute on the same
clock, on top of its compute. Its MoE layers are those ``ModelShape.is_moe`` says (DeepSeek-V3's
first 3 layers are dense, the other 58 MoE) and its MTP layer, which is shaped like the last. The
emulated stages (benchmarks/depth/moe.py) wait these numbers and the simulator prices them (its
``CostModel.a2a`` and ``moe_layers``).
"""
from __future__ import annotations

import dataclasses
import os
import statistics

from chimera_schedules import CostModel, Schedule, simulate
from chimera_schedules.ir.actions import Action, Op
from chimera_schedules.ir.layout import Layout
from chimera_schedules.passes.lowering import lower
from chimera_schedules.tools.planner import ModelShape, Profile, costs, even_layout

from .moe import ATTENTION_SHARE
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
                held: Layout | None = None, a2a_fraction: float = 0.0) -> list[StageTimes]:
    """Per model stage (depth x virtual_stages of them, split as ``held`` says, evenly by default),
    seconds of F, I and W; with ``a2a_fraction``, of its all-to-alls and its MoE layers (see the module)."""
    scale = forward_ms / 1e3 / unscaled_forward(shape, profile, depth)
    held = held or even_layout(shape, depth * virtual_stages)
    forward = costs(shape, profile, depth, 1, 1, virtual_stages=virtual_stages, held=held).forward
    out = [StageTimes(f * scale, f * scale, f * scale) for f in forward]
    if not a2a_fraction:
        return out
    layer = shape.moe_layer_forward_flops(1) / profile.flops * scale
    return [dataclasses.replace(t, a2a=a2a_fraction * layer * n, moe_layers=n)
            for t, n in zip(out, moe_layers(shape, held))]


def moe_layers(shape: ModelShape, held: Layout) -> list[int]:
    """Per model stage, its MoE layers: the transformer layers ``shape.is_moe`` says, and its MTP layers
    where the model's last layer is MoE (an MTP layer is shaped like it)."""
    out = []
    for s, st in enumerate(held.stages):
        first = held.first_layer(s)
        out.append(sum(shape.is_moe(i) for i in range(first, first + st.layers)) + st.mtp * shape.is_moe(shape.layers))
    return out


def message_target_ms(shape: ModelShape, profile: Profile, depth: int, forward_ms: float) -> float:
    """What one activation between neighbours should cost on the emulated clock: the profile's p2p time
    of one (latency + s h x 2 bytes / bandwidth) as the same share of the median 1F1B stage forward
    that it is on the profile."""
    p2p = profile.p2p_latency + shape.seq * shape.hidden * 2 / profile.p2p_bandwidth
    return forward_ms * p2p / unscaled_forward(shape, profile, depth)


def cost_model(times: list[StageTimes], p2p_ms: float, first_input_in_weight: bool = False,
               contention: float = 0.0, host_ms: float = 0.0, halves_efficiency: float = 1.0) -> CostModel:
    """The simulator's costs in milliseconds. ``first_input_in_weight``: the runtime does a first
    stage's whole backward in its W and nothing in its I (torch.distributed.pipelining does: its
    first stage has no input gradient to send). A stage without MoE layers is priced as one layer
    whose all-to-all takes no time, as its emulated stage runs (``moe.stage_parts``). ``host_ms``: what
    each part a MoE stage issues adds (``moe.host_ms``), or without MoE what each pass our executor runs
    adds (``executor_host_ms``), both measured at startup. ``halves_efficiency``: a halved action's compute rate
    (``moe.HALVES_EFFICIENCY``)."""
    forward = [t.forward * 1e3 for t in times]
    backward = [(t.input + t.weight) * 1e3 for t in times]
    weight = [t.weight * 1e3 for t in times]
    if first_input_in_weight:
        weight[0] = backward[0]
    moe = {"a2a": [t.a2a * 1e3 for t in times], "moe_layers": [max(1, t.moe_layers) for t in times],
           "attention_share": ATTENTION_SHARE} if any(t.a2a for t in times) else {}
    return CostModel(forward=forward, backward=backward, weight=weight, p2p_latency=p2p_ms, contention=contention,
                     host=host_ms, halves_efficiency=halves_efficiency, **moe)


def a2a_critical_ms(schedule: Schedule, model: CostModel) -> float:
    """The all-to-all time on the critical path of ``schedule`` (one without overlap): its simulated
    makespan at these costs minus its makespan with no all-to-all, our executor's lowered lists under
    gloo's rules."""
    lowered = lower(schedule)
    zero = dataclasses.replace(model, a2a=0.0)
    return simulate(lowered, model, "gloo").makespan - simulate(lowered, zero, "gloo").makespan


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
