"""What validation reads of the checkpoint at --load (config/layer_probes.py; ``parse_args`` hands these
in): each file vouched for by its size and our manifest's digest before anything in it is unpickled."""
from __future__ import annotations

import argparse
import os

from megatron.training.checkpointing import load_args_from_checkpoint

from ..config.layer_probes import SavedCheckpoint
from .checkpointing import LATEST, check_shape, check_sizes, find_checkpoint, read_common
from .integrity import unverifiable


def take_checkpoint_args(load: str, megatron_args: argparse.Namespace) -> None:
    """Megatron-LM's load_args_from_checkpoint, which takes the saved settings into ``megatron_args``, once
    the file they are read from is vouched for; without a checkpoint at ``load`` yet (a first launch), it
    says so and takes nothing, as in Megatron-LM."""
    if os.path.isfile(os.path.join(load, LATEST)):
        folder, fmt = find_checkpoint(load)
        check_sizes(folder, load)
        read_common(folder, fmt, load)  # checks the digests of what is unpickled
    load_args_from_checkpoint(megatron_args)  # torch.load's allow-list is megatron-core's (format.py)


def saved_plan(load: str) -> tuple[list[str], int] | None:
    """The flags --pipeline-schedule auto chose for the run that saved the checkpoint at ``load``, with its
    iteration; None without a checkpoint there (a first launch), or for one saved by a run that did not plan."""
    if not os.path.isfile(os.path.join(load, LATEST)):
        return None
    folder, fmt = find_checkpoint(load)
    check_sizes(folder, load)
    common = read_common(folder, fmt, load)
    plan = getattr(common.get("args"), "pipeline_plan", None)
    return (list(plan), common.get("iteration")) if plan else None


def read_checkpoint(load: str, megatron_args: argparse.Namespace, verify_integrity: bool) -> SavedCheckpoint:
    """The whole checkpoint at ``load`` (sizes and common state only), of the model shape ``megatron_args``
    gives (CheckpointError otherwise); with ``verify_integrity``, why megatron-core's manifest cannot check it."""
    folder, fmt = find_checkpoint(load)
    check_sizes(folder, load)
    common = read_common(folder, fmt, load)
    check_shape(megatron_args, common, load)
    return SavedCheckpoint(format=fmt, common=common,
                           unverifiable=unverifiable(folder, fmt) if verify_integrity else None)
