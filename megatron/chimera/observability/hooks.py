"""The training loop's hooks protocol: fixed points where an observer may act, each a no-op here.

Tests inject faults through it (``megatron/chimera/testing/fault_hooks.py``) and the benchmark times iterations and
actions with it (``benchmarks/quick.py``), so neither patches the loop and the loop holds no test
or benchmark logic. Pass an instance to ``pretrain`` or ``Trainer``. Unlike the logging beside them, which
receives the values it logs, hooks receive the trainer itself: they act on it (a fault test puts a NaN into
a gradient, or a failing forward into a chunk).
"""
from __future__ import annotations


class Hooks:
    def observes_actions(self) -> bool:
        """Whether a subclass watches our executor's actions. Only then does the trainer hand it to the
        executor, which then stamps every compute action (CUDA events on a GPU, read after the flush)."""
        mine = type(self)
        return mine.after_action is not Hooks.after_action or mine.on_action is not Hooks.on_action

    def before_iteration(self, trainer, iteration: int) -> None:
        """Iteration ``iteration`` (1-based) is about to run its pipeline: its forwards and backwards."""

    def after_backward(self, trainer, iteration: int) -> None:
        """Its pipeline has flushed: gradients complete and reduced, loss not yet gathered, optimizer not
        run yet."""

    def during_save(self, trainer, iteration: int) -> None:
        """Every rank has written its part of checkpoint ``iteration``, which is not published yet."""

    def after_action(self, action, held) -> None:
        """Our executor just posted or ran ``action``; ``held()`` gives the tensors it holds now, by why
        (chimera_schedules/runtime/executor.py, the Observer protocol)."""

    def on_action(self, action, start: float, end: float) -> None:
        """A compute action of our executor ran from ``start`` to ``end`` (``time.perf_counter``
        seconds; device time on a GPU, read once after the iteration's flush)."""
