"""Megatron-LM's rerun state machine around our iterations: megatron-core's ``RerunStateMachine`` itself,
driven as Megatron-LM's train_step drives it.

Each iteration's forward and backward run in ``while machine.should_run_forward_backward(...)``; the
results are handed to ``validate_result`` as Megatron-LM hands them (the loss; with --check-for-spiky-loss
the loss against 10 x the largest seen; with --check-for-large-grads the gradient norm against 10 x the
largest seen, to 0.1%); then ``should_checkpoint_and_exit`` gives the verdict. A result it rejects (or an
error it injects, --error-injection-rate) re-runs the iteration in place: the machine restores the random
generators, and our executor replays the iteration's whole schedule from the same global batch (its
iterators are built from the batch at each run) and the same weights (no optimizer step has run). What
the re-run shows is megatron-core's to judge: not reproducible, a transient error (the run exits with
code 17); reproducible, to be re-run elsewhere from a checkpoint (saved now; exit code 16); or, for a
validation that is not fatal (a spiky loss, large gradients), training goes on. --rerun-mode report_stats
re-runs every iteration once and reports how far the results moved. Injected errors follow the machine's
own injector, so their verdicts are megatron-core's.

A NaN or Inf loss or gradient norm is not one of the machine's rejections here: the trainer's NaN policy
(skip the step; --max-consecutive-nan-iterations in a row stop the run) stays as documented in
docs/failures.md, where Megatron-LM 0.19 would re-run and stop.

Two of the machine's steps are CUDA's in megatron-core 0.19, and are the device's here: its all-reduce of
the ranks' requests (a ``device="cuda"`` tensor) and its save of the CUDA generator beside the others
(none without CUDA).
"""
from __future__ import annotations

import random
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import rerun_state_machine as rsm
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from .config.train_spec import RerunSpec

# Megatron-LM 0.19's parser offers report_stats, which megatron-core's RerunMode spells report_determinism_stats
# (Megatron-LM's own initialize then fails on it): the mode it names
MODES = {"report_stats": rsm.RerunMode.REPORT_DETERMINISM_STATS}
SPIKY_LOSS_FACTOR = 10  # Megatron-LM's pretrain_gpt.py
LARGE_GRADS_FACTOR = 10  # megatron-core's gradient buffer
LARGE_GRADS_TOLERANCE = 0.001


class RerunExit(Exception):
    """The machine's verdict ends the run with ``code`` (after a checkpoint when ``checkpoint``)."""

    def __init__(self, code: int, checkpoint: bool):
        self.code, self.checkpoint = code, checkpoint
        super().__init__(f"the rerun state machine ends the run with exit code {code}")


class DeviceRerunStateMachine(rsm.RerunStateMachine):
    """megatron-core's machine with its all-reduce on ``device`` (the process group's) and its saved
    generators CUDA's only where CUDA runs."""

    def __init__(self, device: torch.device, **kwargs):
        self.device = device
        super().__init__(**kwargs)

    def _reduce_any(self, value):
        flags = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags)
        answers = tuple(x > 0 for x in flags.tolist())
        return answers if isinstance(value, list) else answers[0]

    def _save_state(self) -> None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.saved_state = {
            "rng_state": {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                          "torch_rng_state": torch.get_rng_state(),
                          "cuda_rng_state": torch.cuda.get_rng_state() if cuda else None},
            "other_state": self.state_save_func() if self.state_save_func else None}

    def _restore_state(self) -> None:
        saved = self.saved_state["rng_state"]
        random.setstate(saved["random_rng_state"])
        np.random.set_state(saved["np_rng_state"])
        torch.set_rng_state(saved["torch_rng_state"])
        if saved["cuda_rng_state"] is not None:
            torch.cuda.set_rng_state(saved["cuda_rng_state"])
        if self.saved_state["other_state"] and self.state_restore_func:
            self.state_restore_func(self.saved_state["other_state"])


def rerun_machine(spec: RerunSpec, device: torch.device) -> DeviceRerunStateMachine:
    """The machine Megatron-LM's initialize builds from these flags (the model-parallel RNG tracker saved and
    restored beside the generators), installed as megatron-core's one."""
    tracker = get_cuda_rng_tracker()
    machine = DeviceRerunStateMachine(
        device, state_save_func=lambda: {"rng_tracker_states": tracker.get_states()},
        state_restore_func=lambda saved: tracker.set_states(saved["rng_tracker_states"]),
        mode=MODES.get(spec.mode) or rsm.RerunMode(spec.mode),
        error_injector=rsm.RerunErrorInjector(spec.injection_rate, rsm.RerunDiagnostic(spec.injection_type)),
        result_rejected_tracker_filename=spec.tracker_file)
    rsm.destroy_rerun_state_machine()  # a process may build several trainers (tests, benchmarks)
    rsm._set_rerun_state_machine(machine)  # megatron-core's code that asks for the machine gets this one
    return machine


def validate(machine: rsm.RerunStateMachine, spec: RerunSpec, loss: float, grad_norm: float) -> None:
    """What Megatron-LM validates of an iteration, in its order: the loss (where the injector strikes), a
    spiky loss, large gradients."""
    if machine.get_mode() == rsm.RerunMode.DISABLED:
        return
    loss_tensor = torch.tensor(loss, dtype=torch.float64)
    machine.validate_result(result=loss_tensor, rejection_func=lambda _: False, message="lm loss", tolerance=0.0,
                            fatal=True)
    if spec.spiky_loss:
        machine.validate_result(
            result=loss_tensor, rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                                       context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
    if spec.large_grads:
        machine.validate_result(
            result=torch.tensor(grad_norm, dtype=torch.float64),
            rejection_func=partial(machine.is_unexpectedly_large, threshold=LARGE_GRADS_FACTOR, context="grads"),
            message="found unexpected large grads", tolerance=LARGE_GRADS_TOLERANCE, fatal=False)


def verdict(machine: rsm.RerunStateMachine) -> None:
    """After an iteration's runs: raises RerunExit when the machine ends the run."""
    checkpoint, stop, code = machine.should_checkpoint_and_exit()
    if stop:
        raise RerunExit(code, checkpoint)
