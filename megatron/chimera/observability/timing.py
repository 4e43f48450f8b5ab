"""Megatron-LM's timers: megatron-core's ``Timers`` at --timing-log-level, printed as Megatron-LM
prints them ("(min, max) time across ranks (ms):" and one padded line per timer), by the last rank.

Level 0: setup (model and optimizer, data iterators), printed once before training.
Level 1: per iteration, forward-backward (the whole schedule, communication included), the gradient
norm and clipping, the zeros of the gradient (--log-num-zeros-in-grad), and the optimizer step; averaged
over the log interval and printed under each iteration line.
"""
from __future__ import annotations

import torch.distributed as dist
from megatron.core.timers import Timers

from ..config.logging_spec import LogSpec

SETUP = ("model-and-optimizer-setup", "train/valid/test-data-iterators-setup")
ITERATION = ("forward-backward", "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
             "optimizer")


def make_timers(log: LogSpec) -> Timers:
    return Timers(log.timing_level, log.timing_option)


def print_times(timers, names, normalizer: float = 1.0) -> None:
    """Collective (the times are gathered from every rank)."""
    text = timers.get_all_timers_string(list(names), normalizer=normalizer, reset=True, barrier=False)
    if text and dist.get_rank() == dist.get_world_size() - 1:
        print(text, flush=True)
