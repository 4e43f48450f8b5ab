"""One path from a schedule request to a validated schedule, shared by every front end.

Options that do not apply to the chosen schedule are rejected rather than ignored, so a typo such as
``--schedule 1f1b --pipelines 4`` fails loudly instead of silently describing another schedule.
Errors name ScheduleSpec fields; each front end spells them as its own flags (see ``spec.OPTIONS``)."""
from __future__ import annotations

import dataclasses

from .baselines import check_interleaved, gpipe, interleaved, one_f_one_b
from .chimera import check as check_chimera
from .chimera import chimera
from .dualpipe import check as check_dualpipe
from .dualpipe import check_v as check_dualpipev
from .dualpipe import dualpipe, dualpipev
from .errors import require
from .ir import Schedule
from .search import best_order
from .simulator import CostModel, peak_activations
from .spec import OPTION, ScheduleSpec
from .validator import validate
from .zero_bubble import split_backward


def check_options(schedule: str, given: dict) -> None:
    """Each option in ``given`` (field -> value, None if not given) is one of its choices and applies to
    ``schedule``. The trainer asks this on its own for the schedules that build nothing (megatron-core's,
    or depth 1)."""
    for field, value in given.items():
        o = OPTION[field]
        if value is None:
            continue
        if o.choices:
            require(value in o.choices, field, value, f"must be one of {', '.join(o.choices)}")
        require(schedule in o.schedules, field, value, o.scope_rule)


def check(spec: ScheduleSpec) -> ScheduleSpec:
    """Every rule the request must meet, without generating the schedule (``--order best`` takes seconds
    to generate): the spec with its defaults filled in."""
    check_options(spec.schedule, dataclasses.asdict(spec))
    require(spec.stages >= 1, "stages", spec.stages, "must be at least 1")
    require(spec.microbatches >= 1, "microbatches", spec.microbatches, "must be at least 1")
    spec = spec.with_defaults()
    if spec.schedule == "interleaved":
        check_interleaved(spec.stages, spec.microbatches, spec.chunks)
    if spec.schedule == "chimera":
        require(spec.order == "paper" or spec.concat == "direct", "concat", spec.concat,
                "$order best builds its own order for N = K x D; use $concat direct")
        check_chimera(spec.stages, spec.microbatches, spec.pipelines, spec.concat)
    if spec.schedule == "dualpipe":
        check_dualpipe(spec.stages, spec.microbatches)
    if spec.schedule == "dualpipev":
        check_dualpipev(spec.stages, spec.microbatches)
    return spec


def build_spec(spec: ScheduleSpec, costs: CostModel | None = None) -> Schedule:
    """The schedule the spec describes, validated. ``costs`` guide the orders that depend on them
    (``--order best``, more than two Chimera pipelines, where a split backward places its W passes)."""
    spec, costs = check(spec), costs or CostModel()
    result = _generate(spec, costs)
    if spec.split_backward and spec.order != "best":
        # never more live micro-batches than the unsplit schedule's most loaded worker holds
        result = split_backward(result, costs, [max(peak_activations(result))] * spec.stages)
    validate(result)
    return result


def _generate(spec: ScheduleSpec, costs: CostModel) -> Schedule:
    d, n = spec.stages, spec.microbatches
    if spec.schedule == "gpipe":
        return gpipe(d, n)
    if spec.schedule == "1f1b":
        return one_f_one_b(d, n)
    if spec.schedule == "interleaved":
        return interleaved(d, n, spec.chunks)
    if spec.schedule == "dualpipe":
        return dualpipe(d, n)
    if spec.schedule == "dualpipev":
        return dualpipev(d, n)
    if spec.order == "best":
        return best_order(d, n, costs, spec.pipelines, split=bool(spec.split_backward))
    return chimera(d, n, spec.pipelines, spec.concat, costs)


def build(schedule: str, stages: int, microbatches: int, *, costs: CostModel | None = None,
          **options) -> Schedule:
    """``build_spec(ScheduleSpec(schedule, stages, microbatches, **options), costs)``, for short calls."""
    return build_spec(ScheduleSpec(schedule, stages, microbatches, **options), costs)
