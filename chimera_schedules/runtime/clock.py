"""When a compute action ran, as the device saw it.

On the CPU the host runs the work, so ``time.perf_counter`` at the action's edges is its time. On a
GPU the host only launches kernels: a host clock would time the launches. There each edge is a CUDA
event recorded on the current stream, and the events are read once, after the iteration's flush, as
offsets from an origin event whose host time is known (NCCL_MODEL.md rule 8: no host synchronisation
inside the iteration).
"""
from __future__ import annotations

import time

import torch


class Clock:
    """Stamps on ``device``'s timeline; ``seconds`` turns them into ``perf_counter`` seconds. A clock
    nobody reads (``enabled`` False) stamps nothing: an unobserved run records no events."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.cuda, self.enabled = device.type == "cuda", enabled
        self.origin, self.origin_seconds = None, 0.0

    def begin(self) -> None:
        """Start an iteration: the origin every later stamp is read against."""
        if self.cuda and self.enabled:
            self.origin = self.stamp()
        self.origin_seconds = time.perf_counter()

    def stamp(self):
        if not self.enabled:
            return None
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, stamps: list) -> list[float]:
        """The stamps as perf_counter seconds; on a GPU this waits once, for the last of them."""
        if not self.cuda or not stamps:
            return list(stamps)
        stamps[-1].synchronize()
        return [self.origin_seconds + self.origin.elapsed_time(e) / 1e3 for e in stamps]
