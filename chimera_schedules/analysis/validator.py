"""Is a schedule runnable and complete? Checked before any process runs it.

Rules, in the order they are checked (the first violation is reported with its worker and action):
1. shape: one action list per worker, a placement covering every (pipeline, stage), actions within
   range;
2. placement: each action runs on the worker that holds its (pipeline, stage);
3. an overlapped action holds one F and one B or I of two different micro-batches, so neither
   consumes what the other produces (the dataflow rule links one micro-batch's results only), on one
   worker (rule 2); a micro-batch's forward and backward (B or I) on one stage copy run both in halves
   or both whole (a backward runs in the halves its forward ran in);
4. no duplicated action;
5. each micro-batch belongs to exactly one pipeline;
6. completeness: every (pipeline, stage, micro-batch) has one forward and one backward (a B, or an
   I and a W), unless the schedule has no backward at all (evaluation's forward-only lists);
7. local order: a backward after its forward, W after its I, a gradient reduction after the last
   backward of its stage copy;
8. no deadlock: replaying every worker's list in order (sends never block) finishes; otherwise the
   cross-worker wait-for cycle is named. An overlapped action starts once both parts' inputs are there.
Rules 2 and 4 to 7 read an overlapped action as its parts, its forward first.
"""
from __future__ import annotations

from collections import Counter

from ..ir.actions import Op, Overlapped, parts
from ..ir.costs import CostModel
from ..ir.dataflow import compute_part
from ..ir.errors import InvalidSchedule
from ..ir.schedule import Schedule
from .replay import replay

_GRAD_DONE = (Op.BACKWARD, Op.BACKWARD_WEIGHT)  # the pass after which a stage copy's gradient is final


def validate(schedule: Schedule) -> None:
    """Raise InvalidSchedule on the first violated rule; return None for a valid schedule. Of a lowered
    schedule the compute part is checked; its communication is the NCCL checker's (nccl_model.check)."""
    schedule = compute_part(schedule)
    _check_shape(schedule)
    pipeline_of = _check_actions(schedule)
    _check_halves(schedule)
    _check_complete(schedule, pipeline_of)
    _check_local_order(schedule)
    replay(schedule, CostModel(1.0, 1.0))


def _check_shape(s: Schedule) -> None:
    if s.depth < 1 or s.microbatches < 1 or s.virtual_stages < 1:
        raise InvalidSchedule(f"depth, microbatches and virtual stages must be positive "
                              f"(got {s.depth}, {s.microbatches}, {s.virtual_stages})")
    if s.num_workers != s.depth:
        raise InvalidSchedule(f"{s.num_workers} worker lists for {s.depth} stages: need one per worker")
    for p, row in enumerate(s.placement):
        if len(row) != s.stages_per_pipeline:
            raise InvalidSchedule(f"placement of pipeline {p} has {len(row)} stages, "
                                  f"expected {s.stages_per_pipeline}")
        for stage, w in enumerate(row):
            if not 0 <= w < s.num_workers:
                raise InvalidSchedule(f"pipeline {p} stage {stage} is placed on no worker ({w})")


def _check_actions(s: Schedule) -> dict[int, int]:
    seen: set = set()
    pipeline_of: dict[int, int] = {}
    for w, actions in enumerate(s.workers):
        for action in actions:
            for a in parts(action):
                _check_part(s, w, a)
            if action.op is Op.OVERLAPPED:
                _check_overlapped(w, action)
            for a in parts(action):
                if a in seen:
                    raise InvalidSchedule("duplicated action", w, a)
                seen.add(a)
                if a.op is not Op.REDUCE_GRADS:
                    if pipeline_of.setdefault(a.mb, a.pipeline) != a.pipeline:
                        raise InvalidSchedule(f"micro-batch {a.mb} already runs in pipeline "
                                              f"{pipeline_of[a.mb]}: a micro-batch belongs to one pipeline", w, a)
    return pipeline_of


def _check_halves(s: Schedule) -> None:
    """Rule 3's halves: a micro-batch's F and its B or I on one stage copy, both halved or both whole."""
    halved: dict[tuple[int, int, int], bool] = {}
    for w, actions in enumerate(s.workers):
        for action in actions:
            for a in parts(action):
                if a.op not in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT):
                    continue
                key, now = (a.mb, a.pipeline, a.stage), action.op is Op.HALVED
                if halved.setdefault(key, now) != now:
                    raise InvalidSchedule("a micro-batch's backward runs in the halves its forward ran in: halve "
                                          "both its forward and its backward on this stage, or neither", w, action)


def _check_part(s: Schedule, w: int, a) -> None:
    """Rules 1 and 2 for one plain action: in range, on the worker holding its stage copy."""
    if not (0 <= a.pipeline < s.pipelines and 0 <= a.stage < s.stages_per_pipeline):
        raise InvalidSchedule(f"no pipeline {a.pipeline} stage {a.stage} in this schedule", w, a)
    if a.op is Op.REDUCE_GRADS:
        if a.mb != -1:
            raise InvalidSchedule("a gradient reduction names no micro-batch", w, a)
    elif not 0 <= a.mb < s.microbatches:
        raise InvalidSchedule(f"micro-batch {a.mb} out of range 0..{s.microbatches - 1}", w, a)
    holder = s.placement[a.pipeline][a.stage]
    if holder != w:
        raise InvalidSchedule(f"wrong worker: pipeline {a.pipeline} stage {a.stage} is held by "
                              f"worker {holder}", w, a)


def _check_overlapped(w: int, a: Overlapped) -> None:
    """Rule 3: what one overlapped action can run at once. The dataflow rule links results of one
    micro-batch only, so two micro-batches' parts never consume each other's results directly (a
    dependency through other workers is a deadlock, rule 8's)."""
    if a.forward.op is not Op.FORWARD or a.backward.op not in (Op.BACKWARD, Op.BACKWARD_INPUT):
        raise InvalidSchedule("an overlapped action runs one forward (F) and one backward (B or I)", w, a)
    if a.forward.mb == a.backward.mb:
        raise InvalidSchedule("an overlapped action runs two different micro-batches: the backward of "
                              "its own forward needs that forward's result", w, a)


def _check_complete(s: Schedule, pipeline_of: dict[int, int]) -> None:
    present = {(a.op, a.mb, a.pipeline, a.stage) for actions in s.workers for action in actions for a in parts(action)}
    forward_only = all(op is Op.FORWARD for op, *_ in present)
    for m in range(s.microbatches):
        if m not in pipeline_of:
            raise InvalidSchedule(f"dropped action: micro-batch {m} is never run")
        p = pipeline_of[m]
        for stage in range(s.stages_per_pipeline):
            w = s.placement[p][stage]
            where = f"F{m}p{p}s{stage}"
            if (Op.FORWARD, m, p, stage) not in present:
                raise InvalidSchedule(f"dropped action: no forward {where}", w)
            has_b = (Op.BACKWARD, m, p, stage) in present
            has_i = (Op.BACKWARD_INPUT, m, p, stage) in present
            has_w = (Op.BACKWARD_WEIGHT, m, p, stage) in present
            if has_b and (has_i or has_w):
                raise InvalidSchedule(f"micro-batch {m} pipeline {p} stage {stage} has both B and I/W", w)
            if not has_b and not (has_i and has_w) and not forward_only:
                raise InvalidSchedule(f"dropped action: no backward B{m}p{p}s{stage}", w)


def _check_local_order(s: Schedule) -> None:
    for w, actions in enumerate(s.workers):
        done: set = set()
        plain = [a for action in actions for a in parts(action)]
        pending_grads = Counter((a.pipeline, a.stage) for a in plain if a.op in _GRAD_DONE)
        for a in plain:
            key = (a.mb, a.pipeline, a.stage)
            if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and (Op.FORWARD, *key) not in done:
                raise InvalidSchedule("backward before its forward", w, a)
            if a.op is Op.BACKWARD_WEIGHT and (Op.BACKWARD_INPUT, *key) not in done:
                raise InvalidSchedule("weight-gradient pass before its input-gradient pass", w, a)
            if a.op is Op.REDUCE_GRADS and pending_grads[(a.pipeline, a.stage)]:
                raise InvalidSchedule("gradient reduction before the last backward of its stage copy", w, a)
            if a.op in _GRAD_DONE:
                pending_grads[(a.pipeline, a.stage)] -= 1
            done.add((a.op, *key))
