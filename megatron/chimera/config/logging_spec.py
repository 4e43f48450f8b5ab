"""Logging: the iteration line, timers, TensorBoard and W&B, and what Megatron-LM does around iterations
(observability/housekeeping.py: garbage collection, the CUDA cache, profiling)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
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
        return cls(enabled=args.profile, ranks=tuple(args.profile_ranks or ()), step_start=args.profile_step_start,
                   step_end=args.profile_step_end, pytorch=args.use_pytorch_profiler)


@dataclass(frozen=True, kw_only=True)
class WandbSpec:
    """Megatron-LM's Weights & Biases run: ``project`` (--wandb-project), the run's name (--wandb-exp-name),
    its directory (--wandb-save-dir, else Megatron-LM's default: <--save>/wandb) and --wandb-entity."""

    project: str
    exp_name: str | None
    save_dir: str | None
    entity: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WandbSpec | None:
        if not args.wandb_project:
            return None
        save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
        return cls(project=args.wandb_project, exp_name=args.wandb_exp_name, save_dir=save_dir,
                   entity=args.wandb_entity)


@dataclass(frozen=True, kw_only=True)
class SeriesSpec:
    """Megatron-LM's optional log series (observability/series.py writes them): the parameter norm and the
    gradient's zeros in the iteration line, and what TensorBoard and W&B get every ``tensorboard_interval``
    iterations (timers, memory, validation perplexity, world size, loss scale)."""

    params_norm: bool
    num_zeros_in_grad: bool
    timers_to_tensorboard: bool
    memory_to_tensorboard: bool
    validation_ppl_to_tensorboard: bool
    world_size_to_tensorboard: bool
    loss_scale_to_tensorboard: bool
    tensorboard_interval: int
    tensorboard_queue_size: int
    logging_level: int | None
    wandb: WandbSpec | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SeriesSpec:
        return cls(params_norm=args.log_params_norm, num_zeros_in_grad=args.log_num_zeros_in_grad,
                   timers_to_tensorboard=args.log_timers_to_tensorboard,
                   memory_to_tensorboard=args.log_memory_to_tensorboard,
                   validation_ppl_to_tensorboard=args.log_validation_ppl_to_tensorboard,
                   world_size_to_tensorboard=args.log_world_size_to_tensorboard,
                   loss_scale_to_tensorboard=args.log_loss_scale_to_tensorboard,
                   tensorboard_interval=args.tensorboard_log_interval,
                   tensorboard_queue_size=args.tensorboard_queue_size, logging_level=args.logging_level,
                   wandb=WandbSpec.from_args(args))


@dataclass(frozen=True, kw_only=True)
class LogSpec:
    """The iteration line every ``interval`` iterations (with --log-throughput its TFLOP/s field), the
    timers at ``timing_level`` (``barrier_with_l1_time``: a barrier before each level-1 timer), the
    TensorBoard directory, the model-state line per rank (``memory_per_rank``), NVTX ranges, and
    housekeeping: --manual-gc, --empty-unused-memory-level, profiling; the optional series (``series``)."""

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
    series: SeriesSpec

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LogSpec:
        return cls(interval=args.log_interval, throughput=args.log_throughput, timing_level=args.timing_log_level,
                   timing_option=args.timing_log_option, barrier_with_l1_time=args.barrier_with_L1_time,
                   tensorboard_dir=args.tensorboard_dir, memory_per_rank=args.log_memory_per_rank,
                   nvtx_ranges=args.nvtx_ranges, manual_gc=args.manual_gc, manual_gc_interval=args.manual_gc_interval,
                   manual_gc_eval=args.manual_gc_eval, empty_unused_memory_level=args.empty_unused_memory_level,
                   profile=ProfileSpec.from_args(args), series=SeriesSpec.from_args(args))
