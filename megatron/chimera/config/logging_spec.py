"""Logging: the iteration line, timers, TensorBoard, and what Megatron-LM does around iterations
(observability/housekeeping.py: garbage collection, the CUDA cache, profiling)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ProfileSpec:
    """--profile between ``step_start`` and ``step_end`` on ``ranks`` (empty: all), with PyTorch's
    profiler (``pytorch``) or as an nsys capture range."""

    enabled: bool
    ranks: tuple[int, ...]
    step_start: int
    step_end: int
    pytorch: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProfileSpec:
        return cls(args.profile, tuple(args.profile_ranks or ()), args.profile_step_start, args.profile_step_end,
                   args.use_pytorch_profiler)


@dataclass(frozen=True)
class LogSpec:
    """The iteration line every ``interval`` iterations (with --log-throughput its TFLOP/s field), the
    timers at ``timing_level`` (``barrier_with_l1_time``: a barrier before each level-1 timer), the
    TensorBoard directory, the model-state line per rank (``memory_per_rank``), NVTX ranges, and
    housekeeping: --manual-gc, --empty-unused-memory-level, profiling."""

    interval: int
    throughput: bool
    timing_level: int
    timing_option: str
    barrier_with_l1_time: bool
    tensorboard_dir: str | None
    memory_per_rank: bool
    nvtx_ranges: bool
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool
    empty_unused_memory_level: int
    profile: ProfileSpec

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LogSpec:
        return cls(args.log_interval, args.log_throughput, args.timing_log_level, args.timing_log_option,
                   args.barrier_with_L1_time, args.tensorboard_dir, args.log_memory_per_rank, args.nvtx_ranges,
                   args.manual_gc, args.manual_gc_interval, args.manual_gc_eval, args.empty_unused_memory_level,
                   ProfileSpec.from_args(args))
