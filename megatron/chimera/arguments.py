"""pretrain_gpt.py's arguments: Megatron-LM's parser with Chimera's group (config/parser.py), validated by
config/validation.py's rules; an impossible request fails with one line naming the flag and the rule, exit
code 2.

Here, above every layer of the trainer, the rules are handed what they ask of the layers above config
(config/layer_probes.py): the tokenizer (data/), Transformer Engine (model/), the checkpoint at --load
(checkpoint/). config imports none of them.
"""
from __future__ import annotations

import argparse
import sys

from chimera_schedules import ConfigError
from chimera_schedules.ir.spec import flags

from .checkpoint.validation_reads import read_checkpoint, saved_plan, take_checkpoint_args
from .config.auto_plan import asks_auto, base_argv, check_planning_flags, given, planned_argv, quietly, without
from .config.layer_probes import LayerProbes
from .config.parser import PROG, fail, parse, say_no_effect
from .config.validation import validate
from .data.tokenizer import build_tokenizer
from .model import chunk
from .stage_costs import measure

# model/chunk.py itself answers about Transformer Engine, read at each call (tests set its answers)
PROBES = LayerProbes(build_tokenizer=build_tokenizer, transformer_engine=chunk,
                     take_checkpoint_args=take_checkpoint_args, read_checkpoint=read_checkpoint)


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate. Exits with code 2 and one line on an impossible configuration. With
    --pipeline-schedule auto, the planner's flags replace it first (config/auto_plan.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        check_planning_flags(argv)
        plan = None
        if asks_auto(argv):
            argv, plan = planned_argv(argv, lambda given: quietly(lambda: _validated(given, world_size)[0]), saved_plan,
                                      _measurement(argv))
        args, ignored = _validated(argv, world_size)
    except ConfigError as e:
        fail(f"{PROG}: error: {e.message(flags('trainer'))}")
    say_no_effect(ignored)
    if plan is not None:
        args.pipeline_plan = plan  # saved with the checkpoint's args: a resumed auto run keeps it
    return args


def plan_only(argv: list[str], world_size: int) -> list[str]:
    """The flags --pipeline-schedule auto would choose for ``argv`` over ``world_size`` processes, with the
    table that explains them, and nothing else (no checkpoint is read: megatron/chimera/plan.py)."""
    try:
        check_planning_flags(argv)
        return planned_argv(argv, lambda given: quietly(lambda: _validated(given, world_size)[0]), lambda _: None,
                            _measurement(argv))[1]
    except ConfigError as e:
        fail(f"{PROG}: error: {e.message(flags('trainer'))}")


NO_MODEL = ("--load", "--save", "--pretrained-checkpoint")  # a one-process model reads and writes no checkpoint
BATCH_SIZES = ("--step-batch-size-schedule", "--eval-global-batch-size")  # one process runs batches of 1
DATA_FLAGS = ("--data-path", "--mock-data", "--train-data-path", "--per-split-data-args-path", "--data-args-path")
ONE_PROCESS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--context-parallel-size",
               "1", "--expert-model-parallel-size", "1", "--micro-batch-size", "1", "--global-batch-size", "1"]


def model_namespace(argv: list[str]) -> argparse.Namespace:
    """The validated namespace of a launch script's model flags on one process, quietly: what a benchmark
    needs to know of the model. One line naming the flag on an impossible model."""
    try:
        return one_process(argv)
    except ConfigError as e:
        fail(f"{PROG}: error: {e.message(flags('trainer'))}")


def one_process(argv: list[str]) -> argparse.Namespace:
    """The validated namespace of ``argv``'s model on one process (its parallel and batch sizes set to one; the
    schedule a plain 1F1B; no checkpoint; a learning rate, an iteration count and mock data where the flags
    give none), quietly; ConfigError on an impossible model."""
    training = [] if given(argv, "--lr") else ["--lr", "1e-4"]  # required, and no part of the model
    training += [] if given(argv, "--train-iters") or given(argv, "--train-samples") else ["--train-iters", "1"]
    training += [] if any(given(argv, f) for f in DATA_FLAGS) else ["--mock-data"]
    model = without(without(base_argv(argv), NO_MODEL + BATCH_SIZES), ("--use-checkpoint-args",), valued=False)
    model = without(model, ("--rampup-batch-size",), values=3)
    return quietly(lambda: _validated(model + training + ONE_PROCESS + ["--pipeline-schedule", "1f1b"], 1)[0])


def _measurement(argv: list[str]):
    """--pipeline-schedule auto's stage costs measured on this run's devices (stage_costs.py)."""
    return lambda run, sizes: measure(base_argv(argv), run, one_process, sizes)


def _validated(argv: list[str], world_size: int | None) -> tuple[argparse.Namespace, list[str]]:
    """The namespace of ``argv`` and its flags with no effect; ConfigError on an impossible one."""
    args, parser = parse(argv)
    return args, validate(args, parser, argv, world_size, PROBES)
