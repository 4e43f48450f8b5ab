"""Batch-size ramp-up: --step-batch-size-schedule, and Megatron-LM's older --rampup-batch-size, as steps
of (first sample, global batch size) that megatron-core's own calculator runs.

Megatron-LM 0.19 sizes each iteration's global batch with megatron-core's
``StepBatchsizeNumMicroBatchesCalculator``: from the first iteration whose consumed samples reach a step's
threshold, the batch is that step's size. Its thresholds are tokens (Megatron-LM hands it --seq-length);
they are kept here as samples. --rampup-batch-size START INCREMENT SAMPLES is the linear ramp megatron-core
ran until its calculator was removed (0.19 ignores the flag with a deprecation warning): the batch grows
from START by INCREMENT in (--global-batch-size - START) / INCREMENT equal shares of SAMPLES samples, then
stays at --global-batch-size; its steps are that ramp's, exactly.

Each batch size is N micro-batches per pipeline replica, and each N a schedule of its own: the rules a
schedule sets on N (Chimera's N = K x D, ...) are checked for every step before anything starts
(``check_other_batches``), and the trainer builds each step's plan once. The namespace's --global-batch-size
is the last step's (megatron-core's calculator calls it the global batch size): the evaluation's batch,
and the one the LR schedule converts --train-iters and --lr-*-iters into samples with.
"""
from __future__ import annotations

import copy

from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

from chimera_schedules.ir.errors import ConfigError, require

STEP_FLAG, RAMPUP_FLAG = "--step-batch-size-schedule", "--rampup-batch-size"


def ramp_flag(args) -> tuple[str, str] | None:
    """(the flag, its value as typed) of the run's ramp; None without one."""
    if args.step_batch_size_schedule is not None:
        return STEP_FLAG, args.step_batch_size_schedule
    if args.rampup_batch_size is not None:
        return RAMPUP_FLAG, " ".join(map(str, args.rampup_batch_size))
    return None


def batch_steps(args) -> tuple[tuple[int, int], ...] | None:
    """The ramp's (first sample, global batch size) steps, ascending from sample 0; None without a ramp."""
    if args.step_batch_size_schedule is not None:
        parsed = StepBatchsizeNumMicroBatchesCalculator._parse_schedule(args.step_batch_size_schedule,
                                                                       args.seq_length)
        return _distinct(parsed)
    if args.rampup_batch_size is not None:
        return _linear_ramp(*args.rampup_batch_size, args.global_batch_size)
    return None


def _linear_ramp(start: int, increment: int, samples: int, final: int) -> tuple[tuple[int, int], ...]:
    """megatron-core's RampupBatchsizeNumMicroBatchesCalculator as steps: increment k of K starts once
    ``int(consumed / (samples / K))`` reaches k, i.e. at sample ceil(k samples / K)."""
    increments = (final - start) // increment
    return _distinct([(-(-k * samples // increments), start + k * increment) for k in range(increments + 1)])


def _distinct(steps) -> tuple[tuple[int, int], ...]:
    """Steps by threshold, the last of equal thresholds kept (the one the calculator ends on)."""
    return tuple(sorted(dict(steps).items()))


def check_ramp(args) -> None:
    """Before the sizes are checked: the ramp's own rules (Megatron-LM's and its calculator's, which assert
    without naming a flag), then --global-batch-size set to its last step's size."""
    given = ramp_flag(args)
    if given is None:
        return
    flag, text = given
    require(args.step_batch_size_schedule is None or args.rampup_batch_size is None, STEP_FLAG, text,
            f"and {RAMPUP_FLAG} exclude each other")
    require(not args.decrease_batch_size_if_needed, flag, text,
            "cannot be combined with --decrease-batch-size-if-needed (megatron-core's rule)")
    if flag == STEP_FLAG:
        require(args.global_batch_size is None, flag, text,
                "cannot be combined with --global-batch-size: its last step is the global batch (Megatron-LM's rule)")
        _check_step_text(args)
    else:
        _check_rampup(args)
    args.global_batch_size = batch_steps(args)[-1][1]


def _check_step_text(args) -> None:
    text = args.step_batch_size_schedule
    try:
        steps = StepBatchsizeNumMicroBatchesCalculator._parse_schedule(text, args.seq_length)
    except ValueError as e:
        raise ConfigError(STEP_FLAG, text, f"{e} (THRESHOLD:BATCH_SIZE pairs, thresholds in tokens)") from None
    require(steps[0][0] == 0, STEP_FLAG, text, "its first threshold must be 0 (megatron-core's rule)")
    require(len({t for t, _ in steps}) == len(steps), STEP_FLAG, text,
            f"its thresholds must increase (in samples of --seq-length {args.seq_length} tokens: "
            f"{', '.join(str(t) for t, _ in steps)})")
    require(all(size > 0 for _, size in steps), STEP_FLAG, text, "every batch size must be positive")


def _check_rampup(args) -> None:
    start, increment, samples = args.rampup_batch_size
    text, final = " ".join(map(str, args.rampup_batch_size)), args.global_batch_size
    require(final is not None, RAMPUP_FLAG, text, "needs --global-batch-size, the batch size it ramps up to")
    require(start > 0 and increment > 0 and samples >= 0, RAMPUP_FLAG, text,
            "START and INCREMENT must be positive, SAMPLES not negative")
    require(start <= final and (final - start) % increment == 0, RAMPUP_FLAG, text,
            f"--global-batch-size ({final}) must be START plus a whole number of INCREMENTs (megatron-core's rule)")


def other_batches(args) -> list[tuple[str, int]]:
    """(what asks for it, global batch size) of every batch size the run takes besides --global-batch-size, each
    once: a ramp's earlier steps, and --eval-global-batch-size, the evaluation's (Megatron-LM's default: the
    global batch)."""
    steps = batch_steps(args) or ()
    others = {size: f"the step at sample {first} (global batch size {size})" for first, size in steps[:-1]}
    evaluation = args.eval_global_batch_size
    if evaluation is not None:
        others.setdefault(evaluation, f"global batch size {evaluation}")
    others.pop(args.global_batch_size, None)
    return [(where, size) for size, where in others.items()]


def check_other_batches(args, check_schedule) -> None:
    """Every other batch size the run takes (``other_batches``) as --global-batch-size would be checked: whole
    micro-batches per data-parallel rank (megatron-core's calculator asserts it when it reaches a step), and
    ``check_schedule``'s rules for the N it gives. A failure names the ramp's step, or the evaluation's flag."""
    require(args.eval_micro_batch_size in (None, args.micro_batch_size), "--eval-micro-batch-size",
            args.eval_micro_batch_size, f"must be --micro-batch-size ({args.micro_batch_size}): the evaluation "
            "runs the training's micro-batches through its schedule")
    per_step = args.micro_batch_size * args.data_parallel_size
    for where, size in other_batches(args):
        given = ramp_flag(args) if where.startswith("the step") else ("--eval-global-batch-size", size)
        require(size % per_step == 0, *given, f"{where}: must be a multiple of micro-batch size x data-parallel "
                f"size = {per_step}")
        at = copy.copy(args)
        at.global_batch_size = size
        try:
            check_schedule(at)
        except ConfigError as e:  # its option and rule spelled by whoever prints it, as they would be
            option = e.option if e.option.startswith("-") else "${" + e.option + "}"
            raise ConfigError(*given, f"{where}: {option}={e.value}: {e.rule}") from None


def iterations_for(steps: tuple[tuple[int, int], ...], samples: int) -> int:
    """Iterations until ``samples`` are consumed (Megatron-LM's update_train_iters under a ramp)."""
    calculator = step_calculator(steps, micro_batch_size=1, data_parallel_size=1)
    iterations = consumed = 0
    while consumed < samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    return iterations


def step_calculator(steps, *, micro_batch_size: int, data_parallel_size: int):
    """megatron-core's calculator over ``steps`` (thresholds in samples); quiet (its rank-0 log lines are
    the startup's ramp line here)."""
    text = " ".join(f"{threshold}:{size}" for threshold, size in steps)
    return StepBatchsizeNumMicroBatchesCalculator(micro_batch_size, data_parallel_size, False, 1, text)
