"""The run's length and its learning-rate schedule: --train-iters or --train-samples, and megatron-core's
OptimizerParamScheduler settings they give (the optimizer's section, train_spec.py, carries them), checked
while parsing, and against the schedule a checkpoint at --load was trained with."""
from __future__ import annotations

from chimera_schedules.ir.errors import require

from .batch_ramp import batch_steps, iterations_for


def check_training_length(args) -> None:
    """--train-iters, or Megatron-LM's --train-samples (then --train-iters is derived, as Megatron-LM derives
    it when training starts, under a batch-size ramp by running its steps, and the LR schedule counts samples,
    with the sample-based warmup and decay flags)."""
    require((args.train_iters is None) != (args.train_samples is None), "--train-iters", args.train_iters,
            "give exactly one of --train-iters and --train-samples")
    require(args.lr_warmup_fraction is None or 0 <= args.lr_warmup_fraction <= 1 and not args.lr_warmup_iters
            and not args.lr_warmup_samples, "--lr-warmup-fraction", args.lr_warmup_fraction,
            "must be in [0, 1], without --lr-warmup-iters or --lr-warmup-samples")
    unit = "samples" if args.train_samples else "iters"
    if args.train_samples is None:
        for flag, value in (("--lr-warmup-samples", args.lr_warmup_samples),
                            ("--lr-decay-samples", args.lr_decay_samples)):
            require(not value, flag, value, "goes with --train-samples; with --train-iters use the -iters flag")
    else:
        g, steps = args.global_batch_size, batch_steps(args)
        require(args.train_samples > 0 and (steps or args.train_samples % g == 0), "--train-samples",
                args.train_samples, f"must be a positive multiple of --global-batch-size ({g})")
        for flag, value in (("--lr-warmup-iters", args.lr_warmup_iters), ("--lr-decay-iters", args.lr_decay_iters)):
            require(not value, flag, value, "goes with --train-iters; with --train-samples use the -samples flag")
        args.train_iters = iterations_for(steps, args.train_samples) if steps else args.train_samples // g
    require(args.train_iters > 0, "--train-iters", args.train_iters, "must be positive")
    schedule = lr_schedule(args)  # megatron-core's scheduler asserts this without naming a flag
    per = 1 if args.train_samples else args.global_batch_size  # its samples in the flags' unit
    warmup, decay = schedule["lr_warmup_steps"], schedule["lr_decay_steps"]
    require(warmup < decay, "--lr-warmup-fraction" if args.lr_warmup_fraction is not None else f"--lr-warmup-{unit}",
            warmup / per if warmup % per else warmup // per, f"must be below the decay length, {decay // per}"
            f" (--lr-decay-{unit}, or else --train-{unit})")


def lr_schedule(args) -> dict:
    """megatron-core's OptimizerParamScheduler settings (the ones it checks on load), in samples, as Megatron-LM
    counts them: each iteration steps the schedule by its global batch; --train-iters and --lr-*-iters count
    --global-batch-size samples each (under a batch-size ramp, its last step's), so that Megatron-LM's own
    load_checkpoint takes the scheduler state our checkpoints hold."""
    g = args.global_batch_size
    if args.train_samples:
        total, decay, warmup = args.train_samples, args.lr_decay_samples or args.train_samples, args.lr_warmup_samples
    else:
        total, decay, warmup = (args.train_iters * g, (args.lr_decay_iters or args.train_iters) * g,
                                args.lr_warmup_iters * g)
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": warmup, "lr_decay_steps": decay,
            "lr_decay_style": args.lr_decay_style, "start_wd": _or(args.start_weight_decay, args.weight_decay),
            "end_wd": _or(args.end_weight_decay, args.weight_decay), "wd_incr_steps": total,
            "wd_incr_style": args.weight_decay_incr_style}


def _or(value, default):
    return default if value is None else value


_SCHEDULE_FLAG = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters/-samples/-fraction",
                  "lr_decay_steps": "--lr-decay-iters/-samples", "lr_decay_style": "--lr-decay-style",
                  "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
                  "wd_incr_steps": "--train-iters/-samples", "wd_incr_style": "--weight-decay-incr-style"}


def check_resumed_schedule(args, saved: dict) -> None:
    """As Megatron-LM: resuming with another LR schedule than the checkpoint's (``saved``) is an error
    unless one of the two flags says which schedule wins."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    for key, value in lr_schedule(args).items():
        require(saved.get(key, value) == value, _SCHEDULE_FLAG[key], value,
                f"the checkpoint in {args.load} was trained with {key} {saved.get(key)}; pass "
                f"--override-opt_param-scheduler to use this run's schedule or --use-checkpoint-opt_param-scheduler "
                f"to keep the checkpoint's")
