"""One held stage copy (a model chunk) and what it keeps between its passes, as torch.distributed.pipelining's
PipelineStage: the executor hands a stage its input or output gradient and takes back its output or input
gradient; the stage keeps, per micro-batch, what the backward needs (``Saved``) and the W that completes an
I. A forward runs ``forward_step_func`` on the chunk and, on a last stage, computes the loss, whose report
is kept. B is one backward; I and W are its two halves (autograd_split.py): I the input gradient, W later
the same micro-batch's weight gradients.

``PlanStage`` runs the same passes through megatron-core's combined-1F1B protocol (schedule plans, which
--overlap-moe-expert-parallel-comm turns on), so that a forward and a backward can run interleaved, part by
part: the F&B action (``forward_beside``). ``forward_step_func(data_iterator, model,
return_schedule_plan=True)`` returns the micro-batch's plan instead of its output, and
``type(plan).run(f_plan, b_plan, b_grad=g)`` runs a forward, a backward, or an F&B with both, returning
the forward's output; a backward's input gradient lands in the stage input's ``.grad``. A last stage's
loss is computed from the plan's output detached (its gradient is what the plan's backward starts from).
Before a backward that is an I, ``plan.defer_weight_gradients()`` returns the W that completes it. A sent
activation keeps its data there: the plan's nodes hold it for their backward.

A halved forward (``forward_halves``: a ``Halved`` F) runs the micro-batch as two halves split along the
batch dimension (``BATCH``: the stage input [sequence, batch, hidden] on dim 1, the micro-batch's data on
its first) or along its sequence (``SEQUENCE``: dim 0 and the data's second; the model's attention lets
the second half's queries read the first half's keys, model/sequence_halves.py), ``split_data``, one plan
per half (``forward_step_func`` called twice), both run interleaved by ``first.run_halves(second)``.
What the next stage receives, and the gradient a backward hands back, are the whole micro-batch's (the
halves concatenated): the wire format is unchanged. A last stage's loss is
the whole micro-batch's (``_whole``), scaled once. A backward runs as its forward ran: a forward in
halves left two plans, whose backwards run interleaved by ``run_halves``; a whole forward left one plan.
The validator holds a schedule to it (a micro-batch's forward and backward on one stage copy are halved
together), so a halved B or I finds two plans and a pair's backward one.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from ..ir.actions import BATCH, HalvesSplit
from .autograd_split import backward_input, graph_root


class StageKey(NamedTuple):
    """A stage copy: model stage ``stage`` of pipeline ``pipeline``."""

    pipeline: int
    stage: int


class WeightGradients(Protocol):
    """The W that completes an I: autograd_split.WeightPass, or a schedule plan's deferred weight pass."""

    def run(self) -> None: ...

    def kept(self) -> list[torch.Tensor]:
        """The tensors it holds until it runs (what an observer counts as "kept for W")."""


class SchedulePlan(Protocol):
    """A micro-batch's megatron-core schedule plan, as megatron/chimera/model/schedule_plan.py builds it."""

    @staticmethod
    def run(f_plan: SchedulePlan | None, b_plan: SchedulePlan | None, b_grad: torch.Tensor | None = None,
            pre_backward: Callable[[int | None], None] | None = None):
        """megatron-core's ``TransformerModelChunkSchedulePlan.run``: ``pre_backward(vp_stage)`` is called
        when the backward's parts begin, after the forward's first (the wait for ``b_grad``)."""

    def defer_weight_gradients(self) -> WeightGradients: ...

    def run_halves(self, second: SchedulePlan, grads: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Two halves of one micro-batch through one chunk, this plan the first half's, ``second`` the
        other's, interleaved layer by layer so that one half's all-to-all runs while the other computes
        (chimera_schedules/ir/parts.py, ``halves``). ``grads=None``: both forwards, returning
        ``(output_first, output_second)``; ``grads=(g_first, g_second)``: both backwards, each plan's
        input getting its ``.grad`` as ``run(None, plan, b_grad)`` gives it; returns None."""


@dataclass
class ForwardStep:
    """What every stage of one call shares: megatron-core's ``forward_step_func``, how a loss is scaled
    (over ``num_microbatches``, or summed per token), whether this is training, and the loss reports of
    the micro-batches whose last stage is here, in the order they ran."""

    func: Callable
    num_microbatches: int
    per_token: bool
    training: bool
    reports: list = field(default_factory=list)

    def scaled_loss(self, outputs) -> torch.Tensor:
        """The loss a backward starts from, by megatron-core's loss_func conventions: (loss, num_tokens,
        report) or (loss, report); the report is kept."""
        if len(outputs) == 3:
            loss, num_tokens, report = outputs
            if not self.per_token:  # per token: summed, the trainer divides by the global batch's token count
                loss = loss / num_tokens / self.num_microbatches
        else:
            loss, report = outputs
            loss = loss / self.num_microbatches
        self.reports.append(report)
        return loss


def split_data(batch, dim: int):
    """A micro-batch's data (what a data iterator yields) as its two halves along ``dim`` of every tensor:
    a tensor in two, a dict key by key, None as None."""
    if batch is None:
        return None, None
    if isinstance(batch, torch.Tensor):
        assert batch.dim() > dim and batch.shape[dim] % 2 == 0, \
            f"a micro-batch of shape {tuple(batch.shape)} does not split into two halves along dimension {dim}"
        return tuple(batch.chunk(2, dim=dim))
    if isinstance(batch, dict):
        halves = {key: split_data(value, dim) for key, value in batch.items()}
        return tuple({key: pair[k] for key, pair in halves.items()} for k in (0, 1))
    raise TypeError(f"a micro-batch runs in halves when its data is tensors or dicts of them, "
                    f"not {type(batch).__name__}")


def _whole(first: tuple, second: tuple, split: HalvesSplit) -> tuple:
    """Two halves' loss_func outputs as the whole micro-batch's, by megatron-core's conventions: (loss sum,
    num_tokens, report) summed term by term, a report's [sum, count] tensors key by key; (loss, report),
    a mean over the micro-batch, the halves' mean (equal halves of its sequences; the halves of a
    sequence may hold unequal counts of the tokens the loss counts, so their means do not make the whole's)."""
    if len(first) == 3:
        report = {key: value + second[2][key] for key, value in first[2].items()}
        return first[0] + second[0], first[1] + second[1], report
    assert split == BATCH, "a micro-batch split along its sequence needs loss_func's (loss sum, num_tokens, report)"
    return (first[0] + second[0]) / 2, {key: (value + second[1][key]) / 2 for key, value in first[1].items()}


@dataclass
class Saved:
    """What one micro-batch's forward leaves for its backward: the stage input (a leaf; None on a first
    stage), the output (on a last stage the scaled loss, or, through a plan, the detached output the
    loss was computed from) and where a split backward's I stops (``boundary``)."""

    input: torch.Tensor | None
    output: torch.Tensor
    boundary: torch.Tensor | None

    def tensors(self) -> Iterator[torch.Tensor]:
        return (t for t in (self.input, self.output, self.boundary) if t is not None)


@dataclass
class PlanSaved(Saved):
    """Saved, with the schedule plan the forward ran through and, on a last stage, its scaled loss."""

    plan: SchedulePlan
    loss: torch.Tensor | None


@dataclass
class HalvesSaved(Saved):
    """Saved, for a forward run in two halves: their plans and stage inputs (leaves, where each half's
    backward leaves its input gradient; None on a first stage; the whole input is not kept), on a last
    stage their detached outputs (``output`` is then None) and the whole micro-batch's scaled loss."""

    plans: tuple[SchedulePlan, SchedulePlan]
    inputs: tuple[torch.Tensor | None, torch.Tensor | None]
    outputs: tuple[torch.Tensor, torch.Tensor] | None
    loss: torch.Tensor | None

    def tensors(self) -> Iterator[torch.Tensor]:
        kept = (self.input, self.output, *self.inputs, *(self.outputs or ()))
        return (t for t in kept if t is not None)


class BothWeightPasses:
    """The W of an I run in halves: each half's deferred weight pass, in turn."""

    def __init__(self, *passes: WeightGradients):
        self.passes = passes

    def run(self) -> None:
        for weight_pass in self.passes:
            weight_pass.run()

    def kept(self) -> list[torch.Tensor]:
        return [t for weight_pass in self.passes for t in weight_pass.kept()]


class Stage:
    """One stage copy run through autograd. ``last``: the pipeline's last stage (it computes the loss).
    ``split_backward``: the schedule has I and W; a first stage then keeps its embedding's output, where
    its I stops (megatron-core's GPTModel; without one W runs the whole backward)."""

    releases_sent_outputs = True  # a sent activation's data can go: its backward needs only its graph

    def __init__(self, key: StageKey, chunk: torch.nn.Module, data: Iterator | None, step: ForwardStep, last: bool,
                 split_backward: bool = False):
        self.key, self.chunk, self.data, self.step, self.last = key, chunk, data, step, last
        self.saved: dict[int, Saved] = {}
        self.weight_passes: dict[int, WeightGradients] = {}
        self.embedded: torch.Tensor | None = None  # a first stage's embedding output, until its forward ends
        embedding = getattr(chunk, "embedding", None)
        watch = key.stage == 0 and step.training and split_backward and embedding is not None
        self.hook = embedding.register_forward_hook(self._watch_embedding) if watch else None

    def _watch_embedding(self, _module, _inputs, output: torch.Tensor) -> None:
        self.embedded = output

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()

    def forward(self, mb: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """F: the output the next stage takes (None on a last stage, which keeps its loss's report)."""
        self.chunk.set_input_tensor(x)
        output, loss_func = self.step.func(self.data, self.chunk)
        if self.last:
            output = self.step.scaled_loss(loss_func(output))
        if self.step.training:
            self.saved[mb] = Saved(x, output, self._boundary(x))
        return None if self.last else output

    def _boundary(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Where an I stops: the stage input, or on a first stage its embedding's output (None unwatched)."""
        if self.key.stage > 0:
            return x
        embedded, self.embedded = self.embedded, None
        return embedded

    def output_dtype(self, mb: int) -> torch.dtype:
        """The dtype mb's output gradient takes (it arrives in the transport's)."""
        return self.saved[mb].output.dtype

    def backward(self, mb: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """B: the input gradient (None on a first stage); ``grad`` is None on a last stage."""
        saved = self.saved.pop(mb)
        torch.autograd.backward(graph_root(saved.output) if grad is not None else saved.output, grad_tensors=grad)
        return saved.input.grad if saved.input is not None else None

    def backward_input(self, mb: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """I: the input gradient now, the weight gradients at the same micro-batch's W."""
        saved = self.saved.pop(mb)
        params = [p for p in self.chunk.parameters() if p.requires_grad]
        dx, self.weight_passes[mb] = backward_input(saved.output, grad, saved.boundary, params)
        return dx

    def backward_weight(self, mb: int) -> None:
        """W: the weight gradients its I left."""
        self.weight_passes.pop(mb).run()

    def held(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this stage holds, by why (the Observer protocol's kinds)."""
        return {"unsent": [self.embedded] if self.embedded is not None else [],
                "stage inputs": [t for saved in self.saved.values() for t in saved.tensors()],
                "kept for W": [g for w in self.weight_passes.values() for g in w.kept()]}


class PlanStage(Stage):
    """One stage copy run through schedule plans (the module's docstring), in training."""

    releases_sent_outputs = False  # the plan's nodes hold a sent activation for their backward

    def __init__(self, key: StageKey, chunk: torch.nn.Module, data: Iterator | None, step: ForwardStep, last: bool,
                 halves: HalvesSplit = BATCH):
        super().__init__(key, chunk, data, step, last)  # its I is the plan's own: no embedding to watch
        self.halves = halves

    def forward(self, mb: int, x: torch.Tensor | None) -> torch.Tensor | None:
        plan, loss_func = self._plan(x, self.data)
        return self._keep(mb, x, type(plan).run(plan, None), loss_func, plan)

    def backward(self, mb: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        return self._backward(mb, grad, split=False)

    def backward_input(self, mb: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        return self._backward(mb, grad, split=True)

    def forward_beside(self, mb: int, x: torch.Tensor | None, other: PlanStage, other_mb: int,
                       grad: torch.Tensor | None, split: bool, wait_grad: Callable[[], None] = lambda: None
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """F&B: this stage's forward of ``mb`` beside ``other``'s B (or, ``split``, I) of ``other_mb``,
        interleaved part by part by their plans (megatron-core's combined 1F1B). ``grad`` is filled by
        ``wait_grad``, which the plans call when the backward's parts begin (``pre_backward``). The
        forward's output for the next stage and the backward's input gradient. The backward's forward ran
        whole (the validator's rule: a pair's backward is not halved, so neither was its forward)."""
        assert not isinstance(other.saved[other_mb], HalvesSaved), \
            f"micro-batch {other_mb}'s forward ran in halves: its backward cannot run beside another forward"
        plan, loss_func = self._plan(x, self.data)
        saved, b_grad = other._start_backward(other_mb, grad, split)
        run = type(plan).run(plan, saved.plan, b_grad=b_grad, pre_backward=lambda _vp_stage: wait_grad())
        output = self._keep(mb, x, run, loss_func, plan)
        return output, saved.input.grad if saved.input is not None else None

    def _backward(self, mb: int, grad: torch.Tensor | None, split: bool) -> torch.Tensor | None:
        """B, or (``split``) I, as mb's forward ran: whole, or in halves (``_backward_halves``)."""
        if isinstance(self.saved[mb], HalvesSaved):
            return self._backward_halves(mb, grad, split)
        saved, b_grad = self._start_backward(mb, grad, split)
        type(saved.plan).run(None, saved.plan, b_grad=b_grad)
        return saved.input.grad if saved.input is not None else None

    def forward_halves(self, mb: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """F in two halves of the micro-batch (the module's docstring): the whole micro-batch's output for
        the next stage (None on a last stage, which keeps the whole micro-batch's loss and report)."""
        inputs = _halves(x, dim=self.halves.input_dim)
        batches = split_data(next(self.data), self.halves.data_dim) if self.data is not None else (None, None)
        (first, first_loss), (second, second_loss) = (
            self._plan(half, iter([batch]) if batch is not None else None) for half, batch in zip(inputs, batches))
        outputs = first.run_halves(second)
        if not self.last:
            output = torch.cat(outputs, dim=self.halves.input_dim)
            self.saved[mb] = HalvesSaved(None, output, None, (first, second), inputs, None, None)
            return output
        outputs = tuple(o.detach().requires_grad_() for o in outputs)
        loss = self.step.scaled_loss(_whole(first_loss(outputs[0]), second_loss(outputs[1]), self.halves))
        self.saved[mb] = HalvesSaved(None, None, None, (first, second), inputs, outputs, loss)
        return None

    def _backward_halves(self, mb: int, grad: torch.Tensor | None, split: bool) -> torch.Tensor | None:
        """B, or (``split``) I, of a forward run in halves, in halves: the whole input gradient (None on a
        first stage); an I leaves both halves' weight gradients to one W."""
        saved = self.saved.pop(mb)
        first, second = saved.plans
        if saved.loss is not None:
            torch.autograd.backward(saved.loss)
            grads = tuple(o.grad for o in saved.outputs)
        else:
            grads = _halves(grad, dim=self.halves.input_dim)
        if split:
            self.weight_passes[mb] = BothWeightPasses(first.defer_weight_gradients(), second.defer_weight_gradients())
        first.run_halves(second, grads=grads)
        if saved.inputs[0] is None:
            return None
        return torch.cat([half.grad for half in saved.inputs], dim=self.halves.input_dim)

    def _plan(self, x: torch.Tensor | None, data: Iterator | None) -> tuple[SchedulePlan, Callable]:
        """The micro-batch's schedule plan and loss function (megatron-core's forward_step convention)."""
        self.chunk.set_input_tensor(x)
        return self.step.func(data, self.chunk, return_schedule_plan=True)

    def _keep(self, mb: int, x, output: torch.Tensor, loss_func: Callable, plan: SchedulePlan) -> torch.Tensor | None:
        """Saves the forward for its backward; on a last stage computes the loss from the plan's output
        detached (the plan's backward starts from that output's gradient)."""
        loss = None
        if self.last:
            output = output.detach().requires_grad_()
            loss = self.step.scaled_loss(loss_func(output))
        self.saved[mb] = PlanSaved(x, output, x, plan, loss)
        return None if self.last else output

    def _start_backward(self, mb: int, grad: torch.Tensor | None, split: bool) -> tuple[PlanSaved, torch.Tensor]:
        """mb's saved forward and what its plan's backward starts from (on a last stage, the loss's
        gradient of the plan's output); for an I (``split``), the plan is told to leave its weight
        gradients to the W."""
        saved = self.saved.pop(mb)
        if saved.loss is not None:
            torch.autograd.backward(saved.loss)
            grad = saved.output.grad
        if split:
            self.weight_passes[mb] = saved.plan.defer_weight_gradients()
        return saved, grad


def _halves(t: torch.Tensor | None, dim: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``t``'s two halves along ``dim``, each a contiguous leaf that requires a gradient when ``t`` does
    (None: two Nones)."""
    if t is None:
        return None, None
    assert t.shape[dim] % 2 == 0, f"a tensor of shape {tuple(t.shape)} does not split into two halves along dim {dim}"
    return tuple(h.detach().contiguous().requires_grad_(t.requires_grad) for h in t.chunk(2, dim=dim))


def make_stages(chunks: dict[StageKey, torch.nn.Module], data: dict[StageKey, Iterator | None], step: ForwardStep,
                last_stage: int, split_backward: bool, plans: bool, halves: HalvesSplit = BATCH
                ) -> dict[StageKey, Stage]:
    """This worker's stages, one per held chunk; through schedule plans when ``plans`` (training only),
    cutting a halved action's micro-batch as ``halves`` says."""
    if plans:
        return {key: PlanStage(key, chunk, data[key], step, key.stage == last_stage, halves)
                for key, chunk in chunks.items()}
    return {key: Stage(key, chunk, data[key], step, key.stage == last_stage, split_backward)
            for key, chunk in chunks.items()}
