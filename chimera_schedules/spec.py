"""What a schedule request is, defined once for every front end.

The CLI (``python -m chimera_schedules``) and the trainer (``pretrain_gpt.py``) spell the options
differently; ``OPTIONS`` holds both spellings with the choices, defaults and help, so neither front end
repeats them, and an error raised with a field name (``ScheduleConfigError("concat", ...)``) can name
each front end's own flag. ``VARIANTS`` names the schedules that the CLI's ``compare``, the planner,
the benchmark and the tests line up against each other.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

SCHEDULES = ("gpipe", "1f1b", "interleaved", "chimera", "dualpipe", "dualpipev")
CONCATS = ("direct", "doubling", "halving")
ORDERS = ("paper", "best")


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule request. ``None`` means "not given": ``build.check`` rejects options the schedule
    does not take and fills in the defaults of those it does."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int | None = None
    pipelines: int | None = None
    concat: str | None = None
    order: str | None = None
    split_backward: bool | None = None

    def with_defaults(self) -> ScheduleSpec:
        """Every option this schedule takes and was not given, set to its default."""
        return replace(self, **{o.field: o.default for o in OPTIONS if o.default is not None
                                and self.schedule in o.schedules and getattr(self, o.field) is None})


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
    default: int | str | None = None
    schedules: tuple[str, ...] = SCHEDULES  # the schedules that take it; the others reject it
    trainer_derives: str = ""

    def describe(self) -> str:
        """The help line: what it is, its choices, the schedules that take it and its default."""
        notes = [f"{' or '.join(self.schedules)} only"] if self.schedules != SCHEDULES else []
        notes += [f"default {self.default}"] if self.default is not None else []
        text = self.help + (f": one of {', '.join(self.choices)}" if self.choices else "")
        return text + (f" ({'; '.join(notes)})" if notes else "")

    @property
    def scope_rule(self) -> str:
        return f"applies to $schedule {' or '.join(self.schedules)} only"


OPTIONS = (
    Option("schedule", "--schedule", "--pipeline-schedule", "pipeline schedule", str, SCHEDULES),
    Option("stages", "--stages", "--pipeline-model-parallel-size", "pipeline depth D = number of workers"),
    Option("microbatches", "--microbatches", "--global-batch-size", "micro-batches per iteration",
           trainer_derives="micro-batches per pipeline replica (global batch / (micro-batch size x "
                           "data-parallel size))"),
    Option("chunks", "--chunks", "--num-layers-per-virtual-pipeline-stage", "model chunks per worker",
           default=2, schedules=("interleaved",),
           trainer_derives="model chunks per worker (--num-layers / (PP x it))"),
    Option("pipelines", "--pipelines", "--chimera-pipelines", "pipelines, an even number", default=2,
           schedules=("chimera",)),
    Option("concat", "--concat", "--chimera-concat", "how basic units join for N > D", str, CONCATS, "direct",
           ("chimera",)),
    Option("order", "--order", "--chimera-order", "order of the actions", str, ORDERS, "paper", ("chimera",)),
    Option("split_backward", "--split-backward", "--split-backward",
           "split each backward into I (input gradient, sent at once) and W (weight gradients, placed into "
           "the bubbles), zero-bubble style", bool, schedules=("1f1b", "chimera")),
)
OPTION = {o.field: o for o in OPTIONS}
# options both front ends take as they are, added from this table
SHARED = ("pipelines", "concat", "order", "split_backward")


def flags(front_end: str) -> dict[str, str]:
    """Field -> flag in ``front_end`` ("cli" or "trainer"), for ``ScheduleConfigError.message``."""
    return {o.field: getattr(o, front_end) for o in OPTIONS}


def add_arguments(group, front_end: str, fields=SHARED) -> None:
    """Add these options to an argparse group as ``front_end`` spells them. Each defaults to None so a
    flag the user did not give stays distinguishable from one given with the default value; the schedule
    library rejects the one and fills in the other. Choices are left to the library too, so a bad value
    gets the same one-line error as every other rule."""
    for field in fields:
        o = OPTION[field]
        if o.type is bool:
            group.add_argument(getattr(o, front_end), action="store_const", const=True, help=o.describe())
        else:
            group.add_argument(getattr(o, front_end), type=o.type, help=o.describe())


# The trainer's own run-time options beside the schedule's, with no Megatron-LM spelling to follow.
TRAINER_OPTIONS = (
    ("--emulate-nccl", {"action": "store_true",
                        "help": "CPU only: run p2p over gloo under NCCL's rules (in-order streams per pair and group, "
                                "sends that wait for their receive), to try a layout before a GPU job"}),
    ("--p2p-host-staging", {"action": "store_true",
                            "help": "GPU compute, gloo communication through host memory: several ranks on one GPU"}),
    ("--max-consecutive-nan-iterations", {"type": int, "default": 5,
                                          "help": "stop after this many iterations in a row with a NaN/Inf loss "
                                                  "or gradient norm"}),
    ("--log-memory-per-rank", {"action": "store_true",
                               "help": "print every rank's model-state bytes after setup, not only the largest"}),
)


def add_trainer_group(parser, megatron_schedules: tuple[str, ...]):
    """pretrain_gpt.py's Chimera group, added to Megatron-LM's own parser as its extra arguments:
    --pipeline-schedule (ours, or megatron-core's own), the schedule options and the run-time ones."""
    group = parser.add_argument_group("Chimera: pipeline schedules and run-time options")
    group.add_argument(OPTION["schedule"].trainer, choices=SCHEDULES + megatron_schedules,
                       help="default: megatron-core's own (1f1b, or interleaved with virtual stages)")
    add_arguments(group, "trainer")
    for flag, kwargs in TRAINER_OPTIONS:
        group.add_argument(flag, **kwargs)
    return parser


VARIANTS = {  # name -> the spec's fields besides depth and micro-batches
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "interleaved v=2": {"schedule": "interleaved", "chunks": 2},
    "chimera direct": {"schedule": "chimera", "concat": "direct"},
    "chimera doubling": {"schedule": "chimera", "concat": "doubling"},
    "chimera halving": {"schedule": "chimera", "concat": "halving"},
    "chimera best": {"schedule": "chimera", "order": "best"},
    "1f1b split": {"schedule": "1f1b", "split_backward": True},
    "chimera split": {"schedule": "chimera", "split_backward": True},
    "chimera split best": {"schedule": "chimera", "split_backward": True, "order": "best"},
    "dualpipe": {"schedule": "dualpipe"},
    "dualpipev": {"schedule": "dualpipev"},
}


def variant(name: str, stages: int, microbatches: int) -> ScheduleSpec:
    """The named variant at depth ``stages`` with ``microbatches`` micro-batches."""
    return ScheduleSpec(stages=stages, microbatches=microbatches, **VARIANTS[name])
