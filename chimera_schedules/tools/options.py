"""The schedule options as argparse flags, for the two front ends: the CLI and pretrain_gpt.py's
Chimera group (added to Megatron-LM's own parser as its extra arguments). Help lines say which
schedules take an option, from the registry."""
from __future__ import annotations

from ..ir.spec import OPTION, SHARED
from ..registry import SCHEDULES, takers


def add_arguments(group, front_end: str, fields=SHARED) -> None:
    """Add these options to an argparse group as ``front_end`` spells them. Each defaults to None so a
    flag the user did not give stays distinguishable from one given with the default value; the registry
    rejects the one and fills in the other. Choices are left to the registry too, so a bad value gets the
    same one-line error as every other rule."""
    for field in fields:
        o = OPTION[field]
        if o.type is bool:  # a switch: giving it sets True, or False for one spelt as a negation
            group.add_argument(getattr(o, front_end), action="store_const", const=o.default is not True,
                               help=describe(field))
        else:
            group.add_argument(getattr(o, front_end), type=o.type, help=describe(field))


def describe(field: str) -> str:
    """An option's help line, naming the schedules that take it."""
    return OPTION[field].describe(takers(field))


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
    ("--balance-pipeline-layout", {"metavar": "PROFILE",
                                   "help": "split the layers over the model stages as the balancer picks for this "
                                           "model, schedule and hardware profile (a JSON path, or a name in "
                                           "profiles/), instead of evenly; prints the layout string it applies, "
                                           "reusable with --pipeline-model-parallel-layout"}),
    ("--pipeline-profile", {"metavar": "PROFILE",
                            "help": "with --pipeline-schedule auto: the hardware profile the planner prices the plans "
                                    "with (a JSON path, or a name in profiles/; default: this device's)"}),
    ("--pipeline-memory-limit-gb", {"type": float,
                                    "help": "with --pipeline-schedule auto: drop the plans whose predicted peak per "
                                            "worker exceeds this many GiB (default: the device's memory less 10%%)"}),
    ("--pipeline-replan", {"action": "store_true",
                           "help": "with --pipeline-schedule auto and --load: plan again instead of keeping the plan "
                                   "the checkpoint was trained with"}),
    ("--log-memory-per-rank", {"action": "store_true",
                               "help": "print every rank's model-state bytes after setup, not only the largest"}),
)


def add_trainer_group(parser, megatron_schedules: tuple[str, ...]):
    """pretrain_gpt.py's Chimera group, added to Megatron-LM's own parser as its extra arguments:
    --pipeline-schedule (ours, or megatron-core's own), the schedule options and the run-time ones."""
    group = parser.add_argument_group("Chimera: pipeline schedules and run-time options")
    group.add_argument(OPTION["schedule"].trainer, choices=SCHEDULES + megatron_schedules + ("auto",),
                       help="default: megatron-core's own (1f1b, or interleaved with virtual stages); auto: the "
                            "planner picks the schedule, its options and the micro-batch size, and prints the flags")
    add_arguments(group, "trainer")
    for flag, kwargs in TRAINER_OPTIONS:
        group.add_argument(flag, **kwargs)
    return parser
