"""Checkpointing: where and when to save and load, and in which format."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from megatron.training.checkpointing import get_checkpoint_tracker_filename

from .schedule_request import resolved_schedule


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """Checkpointing: where and when to save and load, and in which format.

    ``save``/``save_interval``: where and every how many iterations to save (--save, --save-interval).
    ``load``: the checkpoint to resume from; None when there is none, including a first launch with
    --load = --save (``first_launch``, decided as the section is built, right after parsing), whose
    directory ``fresh_start`` then names. What a load restores besides the weights: the optimizer, LR
    scheduler and loss scale (``load_optimizer``: neither --finetune nor --no-load-optim), the RNG states
    (``load_rng``: neither --finetune nor --no-load-rng), the iteration (not with ``finetune``).
    ``strictness``: --dist-ckpt-strictness, megatron-core's handling of keys the checkpoint and the model
    do not share. ``schedule``: --pipeline-schedule as resolved, recorded in the checkpoint's layout.
    ``async_save``: --async-save, which Megatron-LM's validate_args keeps only with --use-persistent-ckpt-worker
    (checkpoint/async_saves.py). ``retain_interval``: --save-retain-interval, as Megatron-LM: a save removes
    the checkpoint before it unless that one's iteration is a multiple of it.
    ``verify_integrity``: --verify-integrity, megatron-core's integrity manifest written at a save and
    checked at a load (checkpoint/integrity.py). ``format``: --ckpt-format, what --save writes (a load
    detects the format). ``save_optimizer``: not --no-save-optim, whether a save holds the optimizer state
    and the LR scheduler."""

    save: str | None
    save_interval: int | None
    load: str | None
    fresh_start: str | None
    finetune: bool
    load_optimizer: bool
    load_rng: bool
    strictness: str
    schedule: str
    async_save: bool
    retain_interval: int | None
    verify_integrity: bool
    format: str
    save_optimizer: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckpointSpec:
        fresh = bool(args.load) and first_launch(args)
        return cls(save=args.save, save_interval=args.save_interval, load=None if fresh else args.load,
                   fresh_start=args.load if fresh else None, finetune=args.finetune,
                   load_optimizer=not (args.finetune or args.no_load_optim),
                   load_rng=not (args.finetune or args.no_load_rng), strictness=args.dist_ckpt_strictness,
                   schedule=resolved_schedule(args), async_save=args.async_save,
                   retain_interval=args.save_retain_interval, verify_integrity=args.verify_integrity,
                   format=args.ckpt_format, save_optimizer=not args.no_save_optim)


def first_launch(args) -> bool:
    """``--save X --load X`` with nothing at X yet (no Megatron-LM tracker file): every Megatron-LM script and
    Slurm requeue does this, so it starts from scratch, unless --exit-on-missing-checkpoint says a missing one
    is an error. A --load elsewhere with no checkpoint is always one (a typo must not train from scratch
    silently)."""
    same = args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
    tracker = get_checkpoint_tracker_filename(args.load)
    return same and not args.exit_on_missing_checkpoint and not os.path.exists(tracker)
