"""An emulated device: pipeline stage modules whose compute is a timed wait.

On a GPU the host only launches work and each rank owns its device, so ranks do not compete for
compute. Eight or sixteen CPU processes on a 2-core machine do, and CPU compute there says more about
the machine than about the schedule. A stage here takes the time a profile gives it without using a
core: its forward, input-gradient and weight-gradient passes each sleep for their share, while the
tensors around them are real (the activation shape of the modelled GPT, the dtype of the pipeline),
so every runtime sends and receives real messages over real process groups.

The backward is split the way torch's autograd splits a real layer's: ``_InputPath`` (I backward)
carries the input to the output, ``_WeightPath`` (W backward) hangs the stage's weight off it, and
``_Join`` is where the two meet (and where the forward waits F). A pass that asks only for the input gradient (our split
backward's I, torch.distributed.pipelining's ``stage_backward_input``) never reaches ``_WeightPath``;
the weight pass restarts at ``_Join`` and runs only ``_WeightPath``. A whole backward runs both.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

SPANS: list[tuple[str, float, float]] = []  # (pass, start, end) of every wait this process ran


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch's forward, input-gradient and weight-gradient pass in one model stage;
    with mixture-of-experts layers (``--a2a-fraction``, benchmarks/depth/moe.py), ``a2a`` seconds of
    all-to-all in each forward, I and whole backward, spread over its ``moe_layers``."""
    forward: float
    input: float
    weight: float
    a2a: float = 0.0
    moe_layers: int = 0

    def scaled(self, factor: float) -> StageTimes:
        return StageTimes(self.forward * factor, self.input * factor, self.weight * factor, self.a2a * factor,
                          self.moe_layers)

    def serial(self) -> StageTimes:
        """The all-to-all inside the passes that spend it (the forward and the input-gradient part of a
        backward): a runtime that runs a MoE layer's parts one after another, as megatron-core's 1F1B
        and interleaved schedules do without their combined 1F1B."""
        return StageTimes(self.forward + self.a2a, self.input + self.a2a, self.weight)


class Device:
    """One stage's emulated device. A pass (a forward, an I, a W, or a whole backward) begins when the
    stage's first piece of work for it runs (``begin``) and each of its waits ends its share later, so
    the real tensor work inside the stage (copies, the autograd engine between its nodes) is part of
    the pass's time, as a GPU's kernels are; what the runtime does around the stage is not."""

    def __init__(self, times: StageTimes):
        self.times, self.deadline, self.begun_by_loss = times, 0.0, False

    def begin(self, by_loss: bool = False) -> None:
        """A pass begins now; a backward that the loss began continues at the stage's first node."""
        if not self.begun_by_loss:
            self.deadline = time.perf_counter()
        self.begun_by_loss = by_loss

    def wait(self, what: str) -> None:
        """Busy for this pass's share ``what`` (F, I or W) after the pass's previous share: a sleep to a
        deadline, recorded as the device time it stands for."""
        start = self.deadline
        self.deadline += {"F": self.times.forward, "I": self.times.input, "W": self.times.weight}[what]
        while (left := self.deadline - time.perf_counter()) > 0:
            time.sleep(left)
        self.deadline = time.perf_counter()  # a late wake-up delays the pass's next share too
        SPANS.append((what, start, self.deadline))


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, device: Device):
        ctx.device = device
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.device.wait("I")
        return grad.contiguous(), None  # gloo sends only contiguous tensors; a loss's gradient is expanded


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, device: Device):
        ctx.device, ctx.shape = device, weight.shape
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        ctx.device.wait("W")
        return grad.new_zeros(ctx.shape), None


class _Join(torch.autograd.Function):
    """Where the weight path meets the input path: the stage's last node forward and its first
    backward, where a weight pass restarts (so it runs twice when the backward is split)."""

    @staticmethod
    def forward(ctx, h, u, device: Device):
        ctx.device = device
        out = h.clone()
        device.wait("F")
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.device.begin()
        return grad, grad.new_zeros(()), None


class Embedding(torch.nn.Module):
    """A first stage's input layer: the sample (already activation-shaped) plus a learned vector. Its
    output is the boundary a split backward's I stops at, as megatron-core's embedding is."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype))

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return sample + self.weight


class EmulatedStage(torch.nn.Module):
    """One model stage: a real parameter, real activations in and out, emulated compute. ``config``
    is a megatron-core TransformerConfig, which megatron-core's schedules and our executor read (the
    pipeline dtype, the hidden size); torch.distributed.pipelining calls ``forward`` directly."""

    def __init__(self, times: StageTimes, config, first: bool):
        super().__init__()
        self.device, self.config = Device(times), config
        self.weight = torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=config.pipeline_dtype))
        self.embedding = Embedding(config.hidden_size, config.pipeline_dtype) if first else None
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        """megatron-core's convention: a list of one tensor, or the tensor, or None on a first stage."""
        self.input_tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.device.begin()
        if self.embedding is not None:
            x = self.embedding(x)
        h = _InputPath.apply(x, self.device)
        return _Join.apply(h, _WeightPath.apply(self.weight, self.device), self.device)


class _Loss(torch.autograd.Function):
    """One element of the output, as fp32: the last stage's backward begins here, with the gradient
    of the activation's shape that every stage then sends back."""

    @staticmethod
    def forward(ctx, output, device: Device):
        ctx.device, ctx.shape, ctx.dtype = device, output.shape, output.dtype
        return output.reshape(-1)[0].float()

    @staticmethod
    def backward(ctx, grad):
        ctx.device.begin(by_loss=True)
        out = torch.zeros(ctx.shape, dtype=ctx.dtype)
        out.view(-1)[0] = grad
        return out, None


def loss(output: torch.Tensor, _target=None) -> torch.Tensor:
    """A last stage's loss, whichever runtime calls it (torch's with a target). ``output.grad_fn`` is
    the stage's ``_Join`` node, which holds the stage's device."""
    return _Loss.apply(output, output.grad_fn.device)


def forward_step(data_iterator, model: EmulatedStage, return_schedule_plan: bool = False):
    """megatron-core's forward_step_func convention, for its schedules and our executor: a first stage
    reads its sample, a later one the input the schedule set. Asked for a schedule plan (our executor
    with ``schedule_plans``: a MoE stage, benchmarks/depth/moe.py), the plan of the micro-batch's pass
    instead of its output; its loss then reads a detached output, outside any stage's time."""
    x = next(data_iterator) if model.embedding is not None else model.input_tensor
    if return_schedule_plan:
        return model.schedule_plan(x), _plain_loss_report
    return model(x), _loss_report


def _loss_report(output: torch.Tensor):
    value = loss(output)
    return value, {"loss": value.detach()}


def _plain_loss_report(output: torch.Tensor):
    value = output.reshape(-1)[0].float()
    return value, {"loss": value.detach()}
