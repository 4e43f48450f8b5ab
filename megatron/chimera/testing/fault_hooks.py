"""Faults the tests inject, through the training loop's hooks protocol, read once from the environment
by ``python -m megatron.chimera.testing.pretrain_with_faults`` (pretrain_gpt.py with these hooks):

- ``CHIMERA_TEST_FAULT="kill|hang|raise RANK@ITERATION"``: that rank dies (SIGKILL), stays alive but
  silent, or has the first forward of its first model chunk raise a RuntimeError (as a bug or an
  out-of-memory error would), at the start of that (1-based) iteration;
- ``CHIMERA_TEST_NAN_ITERATIONS="2,5"``: rank 0 puts a NaN into one gradient at those iterations;
- ``CHIMERA_TEST_KILL_DURING_SAVE=N``: every rank dies in the middle of writing checkpoint N.
"""
from __future__ import annotations

import os
import signal
import time

from megatron.chimera.observability.hooks import Hooks


class FaultInjection(Hooks):
    def __init__(self, fault: str = "", nan_iterations: frozenset = frozenset(), kill_during_save: int = -1):
        self.fault, self.nan_iterations, self.kill_during_save = fault, nan_iterations, kill_during_save

    @classmethod
    def from_environment(cls) -> FaultInjection:
        nan = os.environ.get("CHIMERA_TEST_NAN_ITERATIONS", "")
        return cls(os.environ.get("CHIMERA_TEST_FAULT", ""), frozenset(int(i) for i in nan.split(",") if i),
                   int(os.environ.get("CHIMERA_TEST_KILL_DURING_SAVE", "-1")))

    def before_iteration(self, trainer, iteration: int) -> None:
        rank = trainer.rt.rank
        if self.fault == f"kill {rank}@{iteration}":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == f"hang {rank}@{iteration}":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            time.sleep(1e6)  # alive but silent, like a rank stuck in a driver call
        if self.fault == f"raise {rank}@{iteration}":
            trainer.models[0].register_forward_pre_hook(_raise_in_forward)

    def after_backward(self, trainer, iteration: int) -> None:
        if iteration in self.nan_iterations and trainer.rt.rank == 0:
            next(p for p in trainer.main.all() if p.grad is not None).grad.view(-1)[0] = float("nan")

    def during_save(self, trainer, iteration: int) -> None:
        if iteration == self.kill_during_save:
            os.kill(os.getpid(), signal.SIGKILL)


def _raise_in_forward(module, args):
    """A forward that fails on this rank itself, not in a communication call."""
    raise RuntimeError("chimera test fault: this forward raised\n(a second line the error line leaves out)")
