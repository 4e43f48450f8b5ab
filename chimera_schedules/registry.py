"""The schedules, one entry each: the options a schedule takes, its rules, its generator, how many
model chunks it puts on a worker, and the named variants that the CLI's ``compare``, the planner, the
benchmark and the tests line up against each other.

Every front end reads this table and nothing else about a schedule: the CLI, the trainer (which checks
a request and derives its model stages before anything starts), the planner and the benchmark. Adding
a schedule is one entry here, its generator in ``generators/``, and its tests.

Options that do not apply to the chosen schedule are rejected rather than ignored, so a typo such as
``--schedule 1f1b --pipelines 4`` fails loudly instead of silently describing another schedule.
Errors name ScheduleSpec fields; each front end spells them as its own flags (``ir/spec.py``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from .analysis.simulator import peak_activations
from .analysis.validator import validate
from .generators.baselines import check_interleaved, gpipe, interleaved, one_f_one_b
from .generators.bitpipe import bitpipe
from .generators.bitpipe import check as check_bitpipe
from .generators.chimera import check as check_chimera
from .generators.chimera import chimera
from .generators.dualpipe import check as check_dualpipe
from .generators.dualpipe import check_v as check_dualpipev
from .generators.dualpipe import dualpipe, dualpipev
from .generators.hanayo import check as check_hanayo
from .generators.hanayo import hanayo
from .generators.search import best_order
from .generators.vshape import check as check_v
from .generators.vshape import v_schedule
from .ir.costs import CostModel
from .ir.errors import ConfigError, require
from .ir.schedule import Schedule
from .ir.spec import ANY, OPTION, ScheduleSpec, parse_stage_costs
from .passes.overlap import overlap_forward_backward
from .passes.zero_bubble import split_backward


@dataclass(frozen=True)
class Entry:
    """One schedule. ``generate(spec, costs)`` makes its compute schedule from a checked spec;
    ``check(spec)`` raises ConfigError on a request it cannot meet; ``pipelines`` and ``virtual_stages``
    say how many copies of the model and how many model stages per worker and pipeline it has, known
    before it is generated (the trainer sizes its model stages with them). ``variants``: named
    requests (name -> the spec's fields besides schedule, depth and micro-batches)."""

    name: str
    generate: Callable[[ScheduleSpec, CostModel], Schedule]
    check: Callable[[ScheduleSpec], None] = lambda spec: None
    options: tuple[str, ...] = ()
    pipelines: Callable[[ScheduleSpec], int] = lambda spec: 1
    virtual_stages: Callable[[ScheduleSpec], int] = lambda spec: 1
    variants: dict = field(default_factory=dict)

    def chunks_per_worker(self, spec: ScheduleSpec) -> int:
        """Model chunks (stage copies) each worker holds."""
        return self.pipelines(spec) * self.virtual_stages(spec)


def _check_chimera(spec: ScheduleSpec) -> None:
    require(spec.order == "paper" or spec.concat == "direct", "concat", spec.concat,
            "$order best builds its own order for N = K x D; use $concat direct")
    check_chimera(spec.depth, spec.microbatches, spec.pipelines, spec.concat)


def _generate_chimera(spec: ScheduleSpec, costs: CostModel) -> Schedule:
    if spec.order == "best":
        return best_order(spec.depth, spec.microbatches, costs, spec.pipelines, split=bool(spec.split_backward),
                          overlap=bool(spec.overlap), halves=spec.halves is not False)
    return chimera(spec.depth, spec.microbatches, spec.pipelines, spec.concat, costs)


ENTRIES = (
    Entry("gpipe", lambda spec, costs: gpipe(spec.depth, spec.microbatches), variants={"gpipe": {}}),
    Entry("1f1b", lambda spec, costs: one_f_one_b(spec.depth, spec.microbatches),
          options=("split_backward", "overlap", "halves"),
          variants={"1f1b": {}, "1f1b split": {"split_backward": True}, "1f1b overlap": {"overlap": True}}),
    Entry("interleaved", lambda spec, costs: interleaved(spec.depth, spec.microbatches, spec.virtual_stages),
          check=lambda spec: check_interleaved(spec.depth, spec.microbatches, spec.virtual_stages),
          options=("virtual_stages",), virtual_stages=lambda spec: spec.virtual_stages,
          variants={"interleaved v=2": {"virtual_stages": 2}}),
    Entry("chimera", _generate_chimera, _check_chimera,
          options=("pipelines", "concat", "order", "split_backward", "overlap", "halves"),
          pipelines=lambda spec: spec.pipelines,
          variants={"chimera direct": {"concat": "direct"}, "chimera doubling": {"concat": "doubling"},
                    "chimera halving": {"concat": "halving"}, "chimera best": {"order": "best"},
                    "chimera split": {"split_backward": True},
                    "chimera split best": {"split_backward": True, "order": "best"},
                    "chimera direct overlap": {"concat": "direct", "overlap": True},
                    "chimera doubling overlap": {"concat": "doubling", "overlap": True},
                    "chimera split overlap": {"split_backward": True, "overlap": True},
                    "chimera split best overlap": {"split_backward": True, "order": "best", "overlap": True}}),
    Entry("dualpipe", lambda spec, costs: dualpipe(spec.depth, spec.microbatches),
          lambda spec: check_dualpipe(spec.depth, spec.microbatches), options=("overlap", "halves"),
          pipelines=lambda spec: 2,
          variants={"dualpipe": {}, "dualpipe overlap": {"overlap": True}}),
    Entry("dualpipev", lambda spec, costs: dualpipev(spec.depth, spec.microbatches),
          lambda spec: check_dualpipev(spec.depth, spec.microbatches), options=("overlap", "halves"),
          virtual_stages=lambda spec: 2, variants={"dualpipev": {}, "dualpipev overlap": {"overlap": True}}),
    *(Entry(f"v-{memory}", lambda spec, costs, memory=memory: v_schedule(spec.depth, spec.microbatches, memory, costs),
            lambda spec: check_v(spec.depth, spec.microbatches), options=("overlap", "halves"),
            virtual_stages=lambda spec: 2, variants={f"v-{memory}": {}, f"v-{memory} overlap": {"overlap": True}})
      for memory in ("min", "half", "zb")),
    Entry("hanayo", lambda spec, costs: hanayo(spec.depth, spec.microbatches, spec.waves, costs),
          lambda spec: check_hanayo(spec.depth, spec.microbatches, spec.waves),
          options=("waves", "split_backward", "overlap", "halves"),
          virtual_stages=lambda spec: 2 * (spec.waves or OPTION["waves"].default),
          variants={"hanayo": {}, "hanayo 2 waves": {"waves": 2}}),
    Entry("bitpipe", lambda spec, costs: bitpipe(spec.depth, spec.microbatches),
          lambda spec: check_bitpipe(spec.depth, spec.microbatches),
          options=("split_backward", "overlap", "halves"), pipelines=lambda spec: 2, virtual_stages=lambda spec: 2,
          variants={"bitpipe": {}, "bitpipe split": {"split_backward": True}, "bitpipe overlap": {"overlap": True}}),
)
REGISTRY = {e.name: e for e in ENTRIES}
SCHEDULES = tuple(REGISTRY)
VARIANTS = {name: {"schedule": e.name, **fields} for e in ENTRIES for name, fields in e.variants.items()}


def takers(option: str) -> tuple[str, ...]:
    """The schedules that take ``option`` (a ScheduleSpec field beyond schedule, depth and micro-batches)."""
    return tuple(e.name for e in ENTRIES if option in e.options + ANY)


def variant(name: str, depth: int, microbatches: int) -> ScheduleSpec:
    """The named variant at depth D = ``depth`` with ``microbatches`` micro-batches."""
    return ScheduleSpec(depth=depth, microbatches=microbatches, **VARIANTS[name])


def check_options(schedule: str, given: dict) -> None:
    """Each option in ``given`` (field -> value, None if not given) is one of its choices and applies to
    ``schedule``. The trainer asks this on its own for the schedules that build nothing (megatron-core's,
    or depth 1)."""
    taken = REGISTRY[schedule].options + ANY if schedule in REGISTRY else ()
    for name, value in given.items():
        o = OPTION[name]
        if value is None or name in ("schedule", "depth", "microbatches"):
            continue
        if o.choices:
            require(value in o.choices, name, value, f"must be one of {', '.join(o.choices)}")
        require(name in taken, name, value, f"applies to $schedule {' or '.join(takers(name))} only")


def check(spec: ScheduleSpec) -> ScheduleSpec:
    """Every rule the request must meet, without generating the schedule (``--order best`` takes seconds
    to generate): the spec with the defaults of the options its schedule takes filled in."""
    require(spec.schedule in REGISTRY, "schedule", spec.schedule, f"must be one of {', '.join(SCHEDULES)}")
    check_options(spec.schedule, dataclasses.asdict(spec))
    require(spec.depth >= 1, "depth", spec.depth, "must be at least 1")
    require(spec.microbatches >= 1, "microbatches", spec.microbatches, "must be at least 1")
    entry = REGISTRY[spec.schedule]
    spec = dataclasses.replace(spec, **{name: OPTION[name].default for name in entry.options
                                        if getattr(spec, name) is None and OPTION[name].default is not None})
    require(spec.overlap or spec.halves is not False, "halves", True, "applies with $overlap only")  # True: given
    if not spec.overlap:
        spec = dataclasses.replace(spec, halves=None)  # a choice among overlapped orders: none without overlap
    entry.check(spec)
    if spec.stage_costs is not None:
        _stage_costs(spec, entry)
    return spec


def _stage_costs(spec: ScheduleSpec, entry: Entry) -> CostModel:
    """The request's stage costs as a cost model's forward and backward, one per model stage."""
    try:
        forward, backward = parse_stage_costs(spec.stage_costs)
    except ValueError as e:
        raise ConfigError("stage_costs", spec.stage_costs, str(e)) from None
    stages = spec.depth * entry.virtual_stages(spec)
    require(len(forward) in (1, stages), "stage_costs", spec.stage_costs,
            f"gives {len(forward)} stages' costs: give one F/B, or one per model stage ({stages})")
    return CostModel(forward=forward * (stages // len(forward)), backward=backward * (stages // len(backward)))


def build_spec(spec: ScheduleSpec, costs: CostModel | None = None) -> Schedule:
    """The schedule the spec describes, validated. ``costs`` guide the orders that depend on them
    (``--order best``, more than two Chimera pipelines, where a split backward places its W passes).
    Overlapping forwards and backwards comes last: it pairs the actions of the final order."""
    spec, costs = check(spec), costs or CostModel()
    if spec.stage_costs is not None:  # the order is built at the request's own stage times
        given = _stage_costs(spec, REGISTRY[spec.schedule])
        costs = dataclasses.replace(costs, forward=given.forward, backward=given.backward, weight=None)
    result = REGISTRY[spec.schedule].generate(spec, costs)
    if spec.split_backward and not result.split_backward:  # a generator may split its own backward
        # never more live micro-batches than the unsplit schedule's most loaded worker holds
        result = split_backward(result, costs, [max(peak_activations(result))] * spec.depth)
    if spec.overlap and not result.meta.get("overlap"):  # a generator may overlap its own order
        result = overlap_forward_backward(result, costs, halves=spec.halves)
    validate(result)
    return result


def build(schedule: str, depth: int, microbatches: int, *, costs: CostModel | None = None,
          **options) -> Schedule:
    """``build_spec(ScheduleSpec(schedule, depth, microbatches, **options), costs)``, for short calls."""
    return build_spec(ScheduleSpec(schedule, depth, microbatches, **options), costs)
