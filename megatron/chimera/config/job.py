"""The run's configuration as typed, frozen sections, built once from Megatron-LM's validated namespace.

``parse_args`` (megatron/chimera/arguments.py) parses and validates Megatron-LM's ``argparse.Namespace``;
``job_config`` then reads it once into the sections below, and each part of the trainer receives only its
section: the run plan is made from ``pipeline`` and ``parallel`` (run_plan.py). The namespace itself travels
on as ``megatron_args``, for Megatron-LM's own functions that take it (its tokenizer and dataset builders,
its FLOP count, the args a checkpoint saves); nothing writes to it after validation.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .checkpoint_spec import CheckpointSpec
from .data_spec import DataSpec
from .logging_spec import LogSpec
from .model_spec import ModelSpec
from .parallel_dims import ParallelDims
from .pipeline_spec import PipelineSpec
from .train_spec import TrainSpec


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Every section of one run. ``megatron_args`` is Megatron-LM's validated namespace, to be passed
    only to Megatron-LM's functions that require it."""

    parallel: ParallelDims
    pipeline: PipelineSpec
    model: ModelSpec
    train: TrainSpec
    checkpoint: CheckpointSpec
    log: LogSpec
    data: DataSpec
    megatron_args: argparse.Namespace


def job_config(args: argparse.Namespace) -> JobConfig:
    """The sections of a namespace that ``parse_args`` accepted."""
    parallel = ParallelDims.from_args(args)
    return JobConfig(parallel=parallel, pipeline=PipelineSpec.from_args(args, parallel),
                     model=ModelSpec.from_args(args), train=TrainSpec.from_args(args),
                     checkpoint=CheckpointSpec.from_args(args), log=LogSpec.from_args(args),
                     data=DataSpec.from_args(args), megatron_args=args)
