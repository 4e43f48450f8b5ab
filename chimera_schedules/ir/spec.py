"""What a schedule request is, defined once for every front end.

The CLI (``python -m chimera_schedules``) and the trainer (``pretrain_gpt.py``) spell the options
differently; ``OPTIONS`` holds both spellings with the choices, defaults and help, so neither front end
repeats them, and an error raised with a field name (``ConfigError("concat", ...)``) can name each
front end's own flag. Which schedules take which option is the registry's (``registry.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

CONCATS = ("direct", "doubling", "halving")
ORDERS = ("paper", "best")


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule request. ``depth`` is the pipeline depth D (workers); ``virtual_stages`` the model
    stages per worker and pipeline (interleaved's v). ``None`` means "not given": ``registry.check``
    rejects options the schedule does not take and fills in the defaults of those it does."""

    schedule: str
    depth: int
    microbatches: int
    virtual_stages: int | None = None
    pipelines: int | None = None
    waves: int | None = None
    concat: str | None = None
    order: str | None = None
    split_backward: bool | None = None
    overlap: bool | None = None
    halves: bool | None = None
    stage_costs: str | None = None


@dataclass(frozen=True)
class Option:
    """A ScheduleSpec field as each front end spells it. ``trainer_derives`` is set when the trainer's
    flag only determines the value (micro-batches come from ``--global-batch-size``): it says what the
    value is, so the trainer's error can explain why the flag it names is wrong."""

    field: str
    cli: str
    trainer: str
    help: str
    type: type = int  # bool: a switch
    choices: tuple[str, ...] | None = None
    default: int | str | bool | None = None  # for the schedules that take it (a switch defaulting to
    # True is spelt as its negation: giving the flag sets False)
    trainer_derives: str = ""

    def describe(self, schedules: tuple[str, ...] = ()) -> str:
        """The help line: what it is, its choices, the ``schedules`` that take it (if not all) and its
        default."""
        notes = [f"{' or '.join(schedules)} only"] if schedules else []
        notes += [f"default {self.default}"] if self.default is not None else []
        text = self.help + (f": one of {', '.join(self.choices)}" if self.choices else "")
        return text + (f" ({'; '.join(notes)})" if notes else "")


OPTIONS = (
    Option("schedule", "--schedule", "--pipeline-schedule", "pipeline schedule", str),
    Option("depth", "--stages", "--pipeline-model-parallel-size", "pipeline depth D = number of workers"),
    Option("microbatches", "--microbatches", "--global-batch-size", "micro-batches per iteration",
           trainer_derives="micro-batches per pipeline replica (global batch / (micro-batch size x "
                           "data-parallel size))"),
    Option("virtual_stages", "--chunks", "--num-layers-per-virtual-pipeline-stage",
           "model chunks per worker (virtual stages)", default=2,
           trainer_derives="model chunks per worker (--num-layers / (PP x it))"),
    Option("pipelines", "--pipelines", "--chimera-pipelines", "pipelines, an even number", default=2),
    Option("waves", "--waves", "--hanayo-waves",
           "Hanayo's waves: the model crosses the workers down and back up this many times (2 x waves chunks "
           "per worker)", default=1),
    Option("concat", "--concat", "--chimera-concat", "how basic units join for N > D", str, CONCATS, "direct"),
    Option("order", "--order", "--chimera-order", "order of the actions", str, ORDERS, "paper"),
    Option("split_backward", "--split-backward", "--split-backward",
           "split each backward into I (input gradient, sent at once) and W (weight gradients, placed into "
           "the bubbles), zero-bubble style", bool),
    Option("overlap", "--overlap", "--overlap-moe-expert-parallel-comm",
           "run each adjacent forward and backward of two micro-batches as one overlapped action, so one's "
           "expert all-to-all hides behind the other's compute", bool),
    Option("halves", "--no-halves", "--no-overlap-moe-halves",
           "with overlap, never run a forward or backward as two interleaved halves of its micro-batch "
           "(where no other micro-batch pairs with it, the halves hide each other's all-to-all); halves "
           "are on by default", bool, default=True),
    Option("stage_costs", "--stage-costs", "--pipeline-stage-costs",
           "each model stage's forward and backward time as F/B, comma-separated, in one unit (ms, say): the "
           "costs the orders that depend on them are built at (--chimera-order best, where a split backward "
           "places its W passes, which pairs overlap, more than two pipelines); one F/B for every stage, or one "
           "per model stage. --pipeline-schedule auto prints the ones it planned with. Default 1/2", str),
)
OPTION = {o.field: o for o in OPTIONS}
# options both front ends take as they are, added from this table (not ``overlap``: the trainer reads
# Megatron-LM's own flag of that name)
SHARED = ("pipelines", "waves", "concat", "order", "split_backward", "halves", "stage_costs")
ANY = ("stage_costs",)  # options every schedule of the library takes


def parse_stage_costs(text: str) -> tuple[list[float], list[float]]:
    """``stage_costs``' forward and backward lists: ValueError naming the form where ``text`` is not 'F/B,...'
    of times, none below zero and not all zero (a stage of the embedding alone may cost nothing worth counting)."""
    try:
        pairs = [tuple(float(t) for t in item.split("/")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 0 for p in pairs) or not sum(map(sum, pairs)):
        raise ValueError("must be F/B (forward and backward time, 0 or more, not all 0) per model stage, "
                         "comma-separated")
    return [p[0] for p in pairs], [p[1] for p in pairs]


def spell_stage_costs(forward: list[float], backward: list[float]) -> str:
    """``stage_costs``' text of these times, four significant digits each."""
    return ",".join(f"{f:.4g}/{b:.4g}" for f, b in zip(forward, backward))


def flags(front_end: str) -> dict[str, str]:
    """Field -> flag in ``front_end`` ("cli" or "trainer"), for ``ConfigError.message``."""
    return {o.field: getattr(o, front_end) for o in OPTIONS}
