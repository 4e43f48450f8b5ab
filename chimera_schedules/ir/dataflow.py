"""The dataflow rule, stated once: what each action consumes and produces.

Every pass and analysis that needs to know when an action can run asks here: the simulator's
replay, the split-backward pass, lowering (which turns cross-worker results into messages), the NCCL
checker, the list scheduler, the CP-SAT search and the executor.

A result is a key ``(kind, pipeline, stage, mb)``:
- ``"F"``: the output activation of a forward;
- ``"G"``: the input gradient a B or I computes (sent upstream);
- ``"I"``: the input-gradient pass itself, which the same micro-batch's W follows.

A result consumed by another model stage is a message ``(kind, pipeline, receiving stage, mb)``:
``"act"`` for an activation (to stage + 1), ``"grad"`` for an input gradient (to stage - 1).

An overlapped action (``Overlapped``) consumes and produces what its parts do: it starts once both
parts' inputs are there and hands on both parts' results when it ends. A halved action (``Halved``)
consumes and produces what its whole action does.
"""
from __future__ import annotations

from dataclasses import replace

from .actions import COMPOUND_OPS, Action, Op, Overlapped, parts
from .channels import reduces
from .schedule import Schedule

Key = tuple[str, int, int, int]
Message = tuple[str, int, int, int]
_BACKWARDS = (Op.BACKWARD, Op.BACKWARD_INPUT)  # the passes that compute an input gradient


def dependencies(action: Action | Overlapped, last_stage: int) -> list[Key]:
    """The results an action consumes: a forward the previous stage's output; B or I its own forward
    and the next stage's input gradient; W its I; an overlapped action what either part consumes."""
    if action.op in COMPOUND_OPS:
        return [key for part in action.parts for key in dependencies(part, last_stage)]
    p, s, m = action.pipeline, action.stage, action.mb
    if action.op is Op.FORWARD:
        return [("F", p, s - 1, m)] if s > 0 else []
    if action.op in _BACKWARDS:
        return [("F", p, s, m)] + ([("G", p, s + 1, m)] if s < last_stage else [])
    if action.op is Op.BACKWARD_WEIGHT:
        return [("I", p, s, m)]
    return []


def products(action: Action | Overlapped) -> list[Key]:
    """The results an action makes (an overlapped action: both parts')."""
    if action.op in COMPOUND_OPS:
        return [key for part in action.parts for key in products(part)]
    p, s, m = action.pipeline, action.stage, action.mb
    if action.op is Op.FORWARD:
        return [("F", p, s, m)]
    if action.op is Op.BACKWARD:
        return [("G", p, s, m)]
    if action.op is Op.BACKWARD_INPUT:
        return [("G", p, s, m), ("I", p, s, m)]
    return []


def producer(key: Key, split: bool) -> Action:
    """The action that makes ``key``; ``split``: the backward runs as I and W."""
    kind, p, s, m = key
    op = Op.FORWARD if kind == "F" else Op.BACKWARD_INPUT if split or kind == "I" else Op.BACKWARD
    return Action(op, m, p, s)


def produced_messages(schedule: Schedule, action: Action | Overlapped) -> list[Message]:
    """The messages a compute action sends to other model stages: at most one per part."""
    last = schedule.stages_per_pipeline - 1
    out = []
    for kind, p, s, m in products(action):
        if kind == "F" and s < last:
            out.append(("act", p, s + 1, m))
        elif kind == "G" and s > 0:
            out.append(("grad", p, s - 1, m))
    return out


def consumed_messages(schedule: Schedule, action: Action | Overlapped) -> list[Message]:
    """The messages a compute action needs from other model stages before it can start: at most one
    per part."""
    last = schedule.stages_per_pipeline - 1
    return [("act" if kind == "F" else "grad", p, part.stage, m)
            for part in parts(action) for kind, p, s, m in dependencies(part, last) if s != part.stage]


def source_worker(schedule: Schedule, message: Message) -> int:
    """The worker that sends ``message``: the one holding the producing stage."""
    kind, pipeline, stage, _ = message
    return schedule.placement[pipeline][stage - 1 if kind == "act" else stage + 1]


def describe(key: Key) -> str:
    kind, p, s, m = key
    name = {"F": "forward", "G": "input gradient", "I": "input-grad pass"}[kind]
    return f"{name} of micro-batch {m}, pipeline {p}, stage {s}"


def forward_only(lowered: Schedule) -> Schedule:
    """What evaluation posts: the forwards and their activations, in the same relative order (a
    subsequence of a consistent order is consistent); an overlapped action's forward runs alone."""
    keep = lambda a: a.op is Op.FORWARD or (a.op in (Op.SEND, Op.RECV) and a.kind == "act")  # noqa: E731
    return replace(lowered, workers=tuple(tuple(p for a in w for p in parts(a) if keep(p)) for w in lowered.workers))


def compute_part(schedule: Schedule) -> Schedule:
    """The compute schedule inside a lowered one (a stage copy's ALLREDUCE back to R; the expert and
    embedding reductions, which no compute action has, dropped); a compute schedule itself."""
    workers = tuple(tuple(Action(Op.REDUCE_GRADS, -1, a.pipeline, a.stage) if a.op is Op.ALLREDUCE else a
                          for a in w if a.op not in (Op.SEND, Op.RECV)
                          and (a.op is not Op.ALLREDUCE or reduces(a.group) == "stage")) for w in schedule.workers)
    return replace(schedule, workers=workers)
