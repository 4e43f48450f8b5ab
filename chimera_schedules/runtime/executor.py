"""Run a lowered schedule on real processes, as a megatron-core forward_backward function.

The executor interprets this worker's lowered list (passes/lowering.py) and knows nothing of which
schedule made it or which channel a message takes. It dispatches each action to the objects that hold
the iteration's state: the messages (messages.py) and one stage per held chunk (stage.py):
- RECV: post a receive into a fresh buffer on the group the action names;
- F: take the input (a posted receive, waited for only now, or a local hand-over) and run the stage's
  forward, keeping its output for the next stage;
- B, I: take the output gradient and run the stage's backward (I: its input-gradient half), keeping the
  input gradient; W: the weight-gradient half the same micro-batch's I left;
- F&B (an ``Overlapped`` action): the forward of one micro-batch and the B or I of another, run as one
  by schedule plans (stage.PlanStage, which ``schedule_plans`` makes every stage in training); the
  backward's gradient is waited for only when its parts begin (megatron-core's ``pre_backward``), after
  the forward's input and first part;
- an F in halves (a ``Halved`` action): as the whole action, its stage running the micro-batch as two
  interleaved halves (stage.PlanStage.forward_halves); a B or I in halves as the whole action, which a
  PlanStage runs as its forward ran: in halves after a forward in halves (stage.py's docstring);
- SEND: post the send of a kept output or input gradient; completed sends are dropped after every action;
- ALLREDUCE: hand the reduction it names to ``GradSync.start`` (asynchronous); the flush
  (``GradSync.finish``) waits for every reduction before the function returns.
Evaluation runs the forward-only part of the same list (``ir/dataflow.forward_only``).

Each action runs inside a profiler range named ``PP:`` and its IR token (``PP:F3p1s2``, ``PP:sA3p0s1>1@down``),
so a trace reads as the lowered list; with ``nvtx_ranges`` on a GPU, an NVTX range of the same name too.
A failure is a PipelineFault placed in the lowered list (faults.py). No action synchronises the host with
the device: an observer's action times are device times (clock.py), read once after the flush.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Protocol

import torch
from torch.profiler import record_function

from ..ir.actions import BATCH, COMPOUND_OPS, Action, Halved, HalvesSplit, Op, Overlapped
from ..ir.dataflow import consumed_messages, forward_only, produced_messages
from ..ir.schedule import Schedule
from .clock import Clock
from .faults import PipelineFault, action_fault, first_line, located, worker_name
from .messages import Messages, Transport
from .stage import ForwardStep, PlanStage, Stage, StageKey, make_stages

__all__ = ["GradSync", "Observer", "make_forward_backward"]


class GradSync(Protocol):
    def start(self, pipeline: int, stage: int, group, channel: str) -> None:
        """Begin the reduction an ALLREDUCE action names: over process group ``group``, of what its
        ``channel`` sums (``ir/channels.reduces``: this stage copy's gradients, the stage's experts, or
        the tied word embedding)."""

    def finish(self) -> None:
        """Complete every reduction started this iteration (and any that span several copies)."""


class Observer(Protocol):
    """What a benchmark or a memory measurement sees of a run (the trainer's hooks implement it)."""

    def after_action(self, action: Action | Overlapped, held: Callable[[], dict[str, list[torch.Tensor]]]) -> None:
        """``action`` was just posted or run on the host; ``held()`` gives the tensors the executor holds
        now, by why: "receive buffers", "unsent" outputs and gradients, sends "in flight", saved "stage
        inputs", and the gradients a split backward has "kept for W" (a W object's ``kept()``).
        autograd's saved tensors are not among them."""

    def on_action(self, action: Action | Overlapped, start: float, end: float) -> None:
        """A compute action ran from ``start`` to ``end`` (perf_counter seconds; device time on a GPU).
        Called for every compute action of the iteration, in order, after its flush; an overlapped F&B
        whole, with one time for both its parts."""


def make_forward_backward(lowered: Schedule, transport: Transport, grad_sync: GradSync,
                          observer: Observer | None = None, nvtx_ranges: bool = False,
                          schedule_plans: bool = False, halves: HalvesSplit = BATCH) -> Callable:
    """A function with megatron-core 0.19's forward_backward keyword signature. ``model`` and
    ``data_iterator`` are lists aligned with ``lowered.held(worker)`` (one chunk per stage copy);
    a data iterator yields its chunk's micro-batches in the order the schedule runs them (None where a
    chunk needs no data). Returns the loss reports of the micro-batches whose last stage is here.
    ``observer`` (the Observer protocol), when given, sees every action as it is posted and every
    compute action's device time after the flush. ``nvtx_ranges`` (--nvtx-ranges) adds an NVTX range
    per action when the device is a GPU (there is no NVTX on the CPU). ``schedule_plans`` runs training's
    forwards and backwards through schedule plans (stage.PlanStage); a schedule with overlapped actions
    or actions in halves needs it; ``halves`` says where a halved action cuts its micro-batch (stage.py).
    megatron-core's options that this executor does not implement are refused when set, not ignored."""
    if any(a.op in (Op.SEND, Op.RECV, Op.ALLREDUCE) and a.batch >= 0 for w in lowered.workers for a in w):
        raise NotImplementedError("batched communication can be checked (validate --comm) but not executed yet")
    if not schedule_plans and any(a.op in COMPOUND_OPS for w in lowered.workers for a in w):
        raise ValueError("a schedule with overlapped forwards and backwards, or actions in halves, runs its "
                         "chunks through schedule plans: pass schedule_plans=True")
    nvtx = nvtx_ranges and transport.device.type == "cuda"
    held = [StageKey(*key) for key in lowered.held(transport.worker)]
    lists = {False: lowered.workers[transport.worker], True: forward_only(lowered).workers[transport.worker]}

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                         micro_batch_size, decoder_seq_length=None, forward_only=False,
                         collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
                         p2p_communicator=None, pg_collection=None, force_all_reduce=False):
        _refuse_unimplemented(collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                              adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
                              pg_collection=pg_collection, force_all_reduce=force_all_reduce,
                              decoder_seq_length=decoder_seq_length if decoder_seq_length != seq_length else None)
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        iterators = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]
        if len(chunks) != len(held) or len(iterators) != len(held):
            raise ValueError(f"worker {transport.worker} holds {len(held)} stage copies {held}; got "
                             f"{len(chunks)} model chunks and {len(iterators)} data iterators")
        if num_microbatches != lowered.microbatches:
            raise ValueError(f"schedule has {lowered.microbatches} micro-batches, called with {num_microbatches}")
        per_token = getattr(chunks[0].config, "calculate_per_token_loss", False)
        step = ForwardStep(forward_step_func, num_microbatches, per_token, training=not forward_only)
        stages = make_stages(dict(zip(held, chunks)), dict(zip(held, iterators)), step, lowered.stages_per_pipeline - 1,
                             lowered.split_backward, plans=schedule_plans and not forward_only, halves=halves)
        messages = Messages(transport, _activation_shape(chunks[0].config, seq_length, micro_batch_size),
                            release_sent=all(stage.releases_sent_outputs for stage in stages.values()))
        clock = Clock(transport.device, enabled=observer is not None)
        iteration = _Iteration(lowered, transport, stages, messages, clock, grad_sync, training=not forward_only)
        iteration.run(lists[forward_only], observer, nvtx)
        return step.reports

    return forward_backward


def _refuse_unimplemented(**options) -> None:
    """megatron-core's forward_backward options this executor does not implement, when set."""
    given = [name for name, value in options.items() if value not in (None, False)]
    if given:
        raise NotImplementedError(f"the schedule executor does not implement {', '.join(given)} "
                                  "(megatron-core's forward_backward options)")


def _activation_shape(config, seq_length: int, micro_batch_size: int) -> tuple:
    """[sequence, batch, hidden] between stages; with context parallelism each context-parallel rank holds
    its 1/CP of the sequence, with sequence parallelism each tensor-parallel rank 1/TP of that, as in
    megatron-core's schedules."""
    seq_length //= getattr(config, "context_parallel_size", 1)
    if config.sequence_parallel:
        seq_length //= config.tensor_model_parallel_size
    return (seq_length, micro_batch_size, config.hidden_size)


class _Iteration:
    """One call's run of this worker's lowered list: each action dispatched to the messages or a stage."""

    def __init__(self, lowered: Schedule, transport: Transport, stages: dict[StageKey, Stage], messages: Messages,
                 clock: Clock, grad_sync: GradSync, training: bool):
        self.lowered, self.transport, self.stages, self.messages = lowered, transport, stages, messages
        self.clock, self.grad_sync, self.training = clock, grad_sync, training

    def run(self, actions: list[Action | Overlapped], observer: Observer | None, nvtx: bool) -> None:
        """Run the list, each action in its profiler range (``_ranges``); the flush waits for every send
        and, in training, every reduction. A PipelineFault shows where in the list it came (faults.located).
        The observer's action times are read after the flush, once."""
        timeline, at = [], None
        self.clock.begin()
        try:
            with torch.no_grad() if not self.training else torch.enable_grad():
                for at, a in enumerate(actions):
                    with _ranges(a, nvtx):
                        started = self.step(a)
                    if started is not None:
                        timeline.append((a, started, self.clock.stamp()))
                    if observer is not None:
                        observer.after_action(a, self.held)
            at = None  # the flush
            self.messages.drain()
        except PipelineFault as fault:
            raise located(fault, actions, at) from fault.__cause__
        finally:
            for stage in self.stages.values():
                stage.close()
        if self.training:
            self._finish()
        if observer is not None:
            self._report(timeline, observer)

    def _finish(self) -> None:
        """The flush's reductions (GradSync.finish): a failure there is a collective's."""
        try:
            self.grad_sync.finish()
        except RuntimeError as e:
            raise PipelineFault(f"{worker_name(self.transport.worker)}: a collective failed at the flush, "
                                f"completing the gradient reductions: {first_line(e)}") from e

    def _report(self, timeline: list, observer: Observer) -> None:
        seconds = self.clock.seconds([stamp for _, start, end in timeline for stamp in (start, end)])
        for i, (a, _, _) in enumerate(timeline):
            observer.on_action(a, seconds[2 * i], seconds[2 * i + 1])

    def held(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this run holds now, by why (the Observer protocol's ``held``)."""
        held = self.messages.held()
        held.update({"stage inputs": [], "kept for W": []})
        for stage in self.stages.values():
            for why, tensors in stage.held().items():
                held[why] += tensors
        return held

    def step(self, a: Action | Overlapped):
        """Post or run one action; a compute action returns the stamp of its start. What the action
        raises itself becomes a fault naming it (faults.action_fault); its waits raise their own."""
        try:
            started = self._dispatch(a)
        except PipelineFault:
            raise
        except Exception as e:  # a RuntimeError (CUDA, out of memory) or any bug in a forward or backward
            raise action_fault(a, e, self.transport.worker, self.transport.ranks, (self.grad_sync,)) from e
        self.messages.reap()
        return started

    def _dispatch(self, a: Action | Overlapped) -> float | None:
        """A compute action's start stamp; None for a post."""
        if a.op is Op.RECV:
            return self.messages.receive(a)
        if a.op is Op.SEND:
            return self.messages.send(a)
        if a.op is Op.ALLREDUCE:
            return self.grad_sync.start(a.pipeline, a.stage, self.transport.groups[a.group], a.group)
        return {Op.FORWARD: self.forward, Op.BACKWARD: self.backward, Op.BACKWARD_INPUT: self.backward,
                Op.BACKWARD_WEIGHT: self.backward_weight, Op.OVERLAPPED: self.overlapped,
                Op.HALVED: self.halved}[a.op](a)

    def forward(self, a: Action, halves: bool = False) -> float:
        stage = self._stage(a)
        x = self._input(a)
        started = self.clock.stamp()  # compute only: waiting for the input is a bubble
        self._hand_on(a, stage.forward_halves(a.mb, x) if halves else stage.forward(a.mb, x))
        return started

    def backward(self, a: Action) -> float:
        """B, or I (the input gradient now, the weight gradients at the same micro-batch's W)."""
        stage = self._stage(a)
        grad = self._output_grad(a, stage)
        started = self.clock.stamp()
        dx = stage.backward(a.mb, grad) if a.op is Op.BACKWARD else stage.backward_input(a.mb, grad)
        self._hand_on(a, dx)
        return started

    def halved(self, a: Halved) -> float:
        """An F in two halves of its micro-batch; a B or I, which its PlanStage runs as the forward ran."""
        whole = a.action
        stage = self._stage(whole)
        assert isinstance(stage, PlanStage), \
            f"{a} runs through schedule plans, but its stage is a {type(stage).__name__}"
        return self.forward(whole, halves=True) if whole.op is Op.FORWARD else self.backward(whole)

    def backward_weight(self, a: Action) -> float:
        started = self.clock.stamp()
        self._stage(a).backward_weight(a.mb)
        return started

    def overlapped(self, a: Overlapped) -> float:
        """F&B: one micro-batch's forward beside another's B or I (stage.PlanStage.forward_beside)."""
        f, b = a.parts
        forward, backward = self._stage(f), self._stage(b)
        assert isinstance(forward, PlanStage) and isinstance(backward, PlanStage), \
            f"{a} runs through schedule plans, but its stages are {type(forward).__name__}s"
        x = self._input(f)
        grad, wait = self._claimed_grad(b, backward)
        started = self.clock.stamp()  # the backward's wait for its gradient is inside the pair, as simulated
        output, dx = forward.forward_beside(f.mb, x, backward, b.mb, grad, split=b.op is Op.BACKWARD_INPUT,
                                            wait_grad=wait)
        self._hand_on(f, output)
        self._hand_on(b, dx)
        return started

    def _stage(self, a: Action) -> Stage:
        return self.stages[StageKey(a.pipeline, a.stage)]

    def _input(self, a: Action) -> torch.Tensor | None:
        """A forward's input: the previous stage's activation, a leaf (None on a first stage)."""
        if a.stage == 0:
            return None
        x = self.messages.take(consumed_messages(self.lowered, a)[0])
        return x.requires_grad_(self.training)  # arrives in the transport dtype

    def _output_grad(self, a: Action, stage: Stage) -> torch.Tensor | None:
        """A backward's incoming gradient: the next stage's, received (None on a last stage)."""
        if stage.last:
            return None
        return self.messages.take(consumed_messages(self.lowered, a)[0]).to(stage.output_dtype(a.mb))

    def _claimed_grad(self, a: Action, stage: Stage) -> tuple[torch.Tensor | None, Callable[[], None]]:
        """A paired backward's incoming gradient, not waited for yet, and its wait (messages.claim)."""
        if stage.last:
            return None, lambda: None
        return self.messages.claim(consumed_messages(self.lowered, a)[0], stage.output_dtype(a.mb))

    def _hand_on(self, a: Action, tensor: torch.Tensor | None) -> None:
        """Keep what a compute action produced for the stage that takes it: a forward's output (None on a
        last stage) or a backward's input gradient (none leaves a first stage)."""
        produced = produced_messages(self.lowered, a)
        if produced:
            self.messages.keep(produced[0], tensor)


def _ranges(a: Action | Overlapped, nvtx: bool) -> AbstractContextManager:
    """The profiler ranges around one action, named as torch.distributed.pipelining names its own
    (``PP:`` and the action), so a trace holds exactly one range per action run. record_function costs
    tens of microseconds even when no profiler listens, hence the check (a profiler that starts inside
    a list sees the actions that follow); ``nvtx`` (--nvtx-ranges, on a GPU) adds an NVTX range of the
    same name for nsys. The ranges are open when this returns and close when its ``with`` ends."""
    profiling = torch.autograd._profiler_enabled()
    if not (profiling or nvtx):
        return _NO_RANGE
    name, ranges = f"PP:{a}", ExitStack()
    if profiling:
        ranges.enter_context(record_function(name))
    if nvtx:
        ranges.enter_context(torch.cuda.nvtx.range(name))
    return ranges


_NO_RANGE = nullcontext()
