"""What Megatron-LM does around iterations besides training: manual garbage collection
(--manual-gc), releasing the CUDA cache (--empty-unused-memory-level) and profiling (--profile, with
megatron-core's NVTX ranges on between --profile-step-start and --profile-step-end under --nvtx-ranges).

Python's collector pauses a rank at unpredictable moments; in a pipeline one paused rank stalls all of
them, so --manual-gc turns it off and collects on every rank at the same iteration boundaries.
"""
from __future__ import annotations

import gc

import torch
from megatron.core.utils import configure_nvtx_profiling

from ..config.logging_spec import LogSpec


class Housekeeping:
    def __init__(self, log: LogSpec, rank: int):
        self.log, self.rank = log, rank
        self.profiler = None
        if log.manual_gc:
            gc.disable()
            gc.collect()

    def before_iteration(self, done: int) -> None:
        """``done`` iterations are complete; the next one is ``done + 1``."""
        profile = self.log.profile
        if (profile.enabled and (not profile.ranks or self.rank in profile.ranks)
                and done == profile.step_start):
            self._start_profiler()

    def after_iteration(self, done: int) -> None:
        log = self.log
        if log.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if log.manual_gc and log.manual_gc_interval and done % log.manual_gc_interval == 0:
            gc.collect()
        if self.profiler is not None:
            self.profiler.step()
            if done >= log.profile.step_end:
                self.stop()

    def around_evaluation(self) -> None:
        if self.log.manual_gc and self.log.manual_gc_eval:
            gc.collect()
        if self.log.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _start_profiler(self) -> None:
        if self.log.nvtx_ranges:  # megatron-core's own ranges, inside the profiled steps as in Megatron-LM
            configure_nvtx_profiling(True)
        if self.log.profile.pytorch:
            handler = (torch.profiler.tensorboard_trace_handler(self.log.tensorboard_dir)
                       if self.log.tensorboard_dir else None)
            self.profiler = torch.profiler.profile(on_trace_ready=handler, record_shapes=True, with_stack=True)
            self.profiler.start()
        elif torch.cuda.is_available():  # an nsys capture range, as Megatron-LM marks it
            torch.cuda.cudart().cudaProfilerStart()
            self.profiler = _NsysRange()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
            if self.log.nvtx_ranges:
                configure_nvtx_profiling(False)


class _NsysRange:
    def step(self) -> None:
        pass

    def stop(self) -> None:
        torch.cuda.cudart().cudaProfilerStop()
