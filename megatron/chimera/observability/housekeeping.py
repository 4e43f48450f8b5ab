"""What Megatron-LM does around iterations besides training: manual garbage collection
(--manual-gc), releasing the CUDA cache (--empty-unused-memory-level) and profiling (--profile, with
megatron-core's NVTX ranges on between --profile-step-start and --profile-step-end under --nvtx-ranges).

Python's collector pauses a rank at unpredictable moments; in a pipeline one paused rank stalls all of
them, so --manual-gc turns it off and collects on every rank at the same iteration boundaries.
"""
from __future__ import annotations

import gc

import torch


class Housekeeping:
    def __init__(self, args, rank: int):
        self.args, self.rank = args, rank
        self.profiler = None
        if args.manual_gc:
            gc.disable()
            gc.collect()

    def before_iteration(self, done: int) -> None:
        """``done`` iterations are complete; the next one is ``done + 1``."""
        args = self.args
        if (args.profile and (not args.profile_ranks or self.rank in args.profile_ranks)
                and done == args.profile_step_start):
            self._start_profiler()

    def after_iteration(self, done: int) -> None:
        args = self.args
        if args.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if args.manual_gc and args.manual_gc_interval and done % args.manual_gc_interval == 0:
            gc.collect()
        if self.profiler is not None:
            self.profiler.step()
            if done >= args.profile_step_end:
                self.stop()

    def around_evaluation(self) -> None:
        if self.args.manual_gc and self.args.manual_gc_eval:
            gc.collect()
        if self.args.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _start_profiler(self) -> None:
        if self.args.nvtx_ranges:  # megatron-core's own ranges, inside the profiled steps as in Megatron-LM
            _megatron_core_nvtx(True)
        if self.args.use_pytorch_profiler:
            handler = (torch.profiler.tensorboard_trace_handler(self.args.tensorboard_dir)
                       if self.args.tensorboard_dir else None)
            self.profiler = torch.profiler.profile(on_trace_ready=handler, record_shapes=True, with_stack=True)
            self.profiler.start()
        elif torch.cuda.is_available():  # an nsys capture range, as Megatron-LM marks it
            torch.cuda.cudart().cudaProfilerStart()
            self.profiler = _NsysRange()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
            if self.args.nvtx_ranges:
                _megatron_core_nvtx(False)


def _megatron_core_nvtx(enabled: bool) -> None:
    from megatron.core.utils import configure_nvtx_profiling

    configure_nvtx_profiling(enabled)


class _NsysRange:
    def step(self) -> None:
        pass

    def stop(self) -> None:
        torch.cuda.cudart().cudaProfilerStop()
