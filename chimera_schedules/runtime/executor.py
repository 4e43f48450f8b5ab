"""Run a lowered schedule on real processes, as a megatron-core forward_backward function.

The executor interprets this worker's lowered list (passes/lowering.py) and knows nothing of which
schedule made it or which channel a message takes:
- RECV: post a receive into a fresh buffer on the group the action names;
- F: take the input (a posted receive, waited for only now, or a local hand-over), run
  ``forward_step_func`` on the chunk, compute the loss on the last stage, keep the output;
- B: backward from the loss or the received output gradient, keep the input gradient;
- I and W: the two halves of a B (autograd_split.py): I keeps the input gradient, W later computes
  the same micro-batch's weight gradients;
- F&B (an ``Overlapped`` action): the forward of one micro-batch and the B or I of another, run as one
  through schedule plans (below);
- SEND: post the send of a kept output or input gradient; a sent activation's own data is released
  at once (the backward needs only its graph), and completed sends are dropped after every action;
- ALLREDUCE: hand the chunk's gradients to ``GradSync.start`` (asynchronous); the flush
  (``GradSync.finish``) waits for every reduction before the function returns.
Evaluation runs the forward-only part of the same list (``ir/dataflow.forward_only``).

Schedule plans (``schedule_plans``, which --overlap-moe-expert-parallel-comm turns on): in training every
forward and backward of a chunk runs through megatron-core's combined-1F1B protocol, so that a forward
and a backward can run interleaved, part by part. ``forward_step_func(data_iterator, model,
return_schedule_plan=True)`` returns the micro-batch's plan instead of its output, and
``type(plan).run(f_plan, b_plan, b_grad=g)`` runs a forward, a backward, or an F&B with both, returning
the forward's output; a backward's input gradient lands in the stage input's ``.grad``. A last stage's
loss is computed from the plan's output detached (its gradient is what the plan's backward starts
from). Before a backward that is an I, ``plan.defer_weight_gradients()`` returns the W that completes it:
an object whose ``run()`` is the W and whose ``kept()`` lists the tensors it holds until then.
A sent activation keeps its data there: the plan's nodes hold it for their backward.
Each action runs inside a profiler range named ``PP:`` and its IR token (``PP:F3p1s2``, ``PP:sA3p0s1>1@down``),
so a trace reads as the lowered list; with ``nvtx_ranges`` on a GPU, an NVTX range of the same name too.
A PipelineFault names the action the worker was at, in the lowered list around it. What failed is told by
where it was raised, not by its text: a communication call (a wait, a post, a reduction, a collective
inside a forward) is a collective failure; anything else a forward or backward raises is a ComputeFault,
this worker's own error, naming the action and keeping the original exception as its cause.
No action synchronises the host with the device: an observer's action times are device times
(clock.py), read once after the flush.
"""
from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..ir.actions import COMPUTE_OPS, Action, Op, Overlapped
from ..ir.dataflow import consumed_messages, forward_only, produced_messages
from ..ir.schedule import Schedule
from .autograd_split import backward_input, graph_root
from .clock import Clock


class PipelineFault(RuntimeError):
    """An iteration's pipeline failed: a peer died or stopped answering, a collective failed, or (a
    ComputeFault) an action raised on this worker. ``headline``, the first line, names the rank and what
    failed (the message it waited for and the peer); ``context``, on the following lines once the
    executor has placed it, shows the worker's lowered list around the action it was at, so the failure
    can be read against the schedule without rerunning it. ``action`` is the action that failed (None
    for the flush's reductions)."""

    def __init__(self, headline: str, context: str = "", action: Action | None = None):
        super().__init__(f"{headline}\n{context}" if context else headline)
        self.headline, self.context, self.action = headline, context, action


class ComputeFault(PipelineFault):
    """An action raised on this worker outside any communication call, as a forward or backward does on
    a bug or out of memory: the fault is here, not a peer's (a peer then sees a collective failure). The
    headline names the action and the original exception's type and first line; the original, with its
    traceback, is the ``__cause__``, which ``trace`` gives."""

    def trace(self) -> str:
        cause = self.__cause__
        return "".join(traceback.format_exception(cause)) if cause is not None else ""


# Where a communication call raises from, besides torch.distributed's own errors (DistError: NCCL, the
# store, the network): inside torch.distributed (a synchronous collective; gloo raises plain
# RuntimeError), and the code that waits on asynchronous handles: our p2p transports (p2p.py) and
# megatron-core's pipeline p2p (its interleaved schedule waits in schedules.py itself).
COMMUNICATION_MODULES = ("torch.distributed", "chimera_schedules.runtime.p2p", "megatron.core.pipeline_parallel")


def raised_by_communication(e: BaseException, helpers: tuple = ()) -> bool:
    """Whether ``e`` came out of a communication call, told by where it was raised, not by its text: a
    DistError, an exception whose innermost frame is in ``COMMUNICATION_MODULES``, or one raised inside
    a method of one of ``helpers``, objects that only communicate (a GradSync, the trainer's collectives)
    and wait on handles from their own frames."""
    if isinstance(e, dist.DistError):
        return True
    frames = [frame for frame, _ in traceback.walk_tb(e.__traceback__)]
    if frames and frames[-1].f_globals.get("__name__", "").startswith(COMMUNICATION_MODULES):
        return True
    return any(frame.f_locals.get("self") is h for frame in frames for h in helpers)


def unattributed_fault(e: Exception, who: str, where: str, helpers: tuple = ()) -> PipelineFault:
    """A failure no action of ours can be named for (megatron-core's own schedules run their own; the
    loss and gradient-norm reductions follow the pipeline): a collective failure when a communication
    call raised it (``raised_by_communication``), else a ComputeFault in ``where``; either has ``e`` as
    its cause, as if raised from it."""
    if raised_by_communication(e, helpers):
        fault = PipelineFault(f"{who}: a collective failed: {_first_line(e)}")
    else:
        fault = ComputeFault(f"{who}: {where} failed: {_raised(e)}")
    fault.__cause__ = e
    return fault


class GradSync(Protocol):
    def start(self, pipeline: int, stage: int, group) -> None:
        """Begin reducing the gradients of this stage copy over ``group`` (its replica group)."""

    def finish(self) -> None:
        """Complete every reduction started this iteration (and any that span several copies)."""


class Observer(Protocol):
    """What a benchmark or a memory measurement sees of a run (the trainer's hooks implement it)."""

    def after_action(self, action: Action | Overlapped, held: Callable[[], list]) -> None:
        """``action`` was just posted or run on the host; ``held()`` gives the tensors the executor holds
        now, by why: "receive buffers", "unsent" outputs and gradients, sends "in flight", saved "stage
        inputs", and the gradients a split backward has "kept for W". autograd's saved tensors are not
        among them."""

    def on_action(self, action: Action | Overlapped, start: float, end: float) -> None:
        """A compute action ran from ``start`` to ``end`` (perf_counter seconds; device time on a GPU).
        Called for every compute action of the iteration, in order, after its flush; an overlapped F&B
        whole, with one time for both its parts."""


@dataclass(frozen=True)
class Transport:
    """Where this worker's peers are. ``ranks[w]`` is the global rank of worker w (same data- and
    tensor-parallel position); ``groups[name]`` the process group a lowered action names (None: the
    default group). ``p2p`` moves the tensors (p2p.py). ``comm_device`` stages p2p through another
    device, e.g. host memory for gloo with CUDA tensors. ``output_rows[s]``: how many activations'
    worth of sequence model stage s sends on (default 1 each): megatron-core's MTP block, on a stage
    of its own, hands the loss stage its depths' hidden states concatenated along the sequence."""

    worker: int
    ranks: Sequence[int]
    groups: dict
    device: torch.device
    dtype: torch.dtype
    p2p: object
    comm_device: torch.device | None = None
    output_rows: Sequence[int] | None = None

    def message_shape(self, shape: tuple, message: tuple) -> tuple:
        """A message's shape: an activation is its producer's (the stage before) output, a gradient
        the consumer's own output's."""
        if self.output_rows is None:
            return shape
        kind, _, stage, _ = message
        rows = self.output_rows[stage - 1 if kind == "act" else stage]
        return (shape[0] * rows, *shape[1:])


class _Messages:
    """One iteration's messages: posted receives, outputs kept for a send or a local consumer, and
    sends in flight. ``release_sent``: free a sent activation's data (its backward needs only its graph)."""

    def __init__(self, transport: Transport, shape: tuple, release_sent: bool = True):
        self.t, self.shape, self.release_sent = transport, shape, release_sent
        self.posted: dict[tuple, tuple] = {}  # message -> (handle, buffer, action)
        self.kept: dict[tuple, torch.Tensor] = {}
        self.sends: dict[tuple, deque] = {}  # (group, peer) -> (handle, tensor kept alive, action), oldest first

    def receive(self, a: Action) -> None:
        buf = torch.empty(self.t.message_shape(self.shape, a.message), dtype=self.t.dtype,
                          device=self.t.comm_device or self.t.device)
        work = self.t.p2p.irecv(buf, self.t.ranks[a.peer], self.t.groups[a.group])
        self.posted[a.message] = (work, buf, a)

    def keep(self, message: tuple | None, tensor: torch.Tensor) -> None:
        if message is not None:
            self.kept[message] = tensor

    def send(self, a: Action) -> None:
        """Post the send. An activation's own data is then released (Megatron's deallocate_output_tensor):
        the send holds what it needs, and the backward needs only the output's graph."""
        kept = self.kept.pop(a.message)
        tensor = kept.detach().to(self.t.comm_device or self.t.device, self.t.dtype).contiguous()
        work = self.t.p2p.isend(tensor, self.t.ranks[a.peer], self.t.groups[a.group])
        self.sends.setdefault((a.group, a.peer), deque()).append((work, tensor, a))
        if self.release_sent and a.kind == "act" and kept.grad_fn is not None and kept._base is None:
            kept.data = torch.empty((1,), dtype=kept.dtype, device=kept.device)

    def reap(self) -> None:
        """Drop the sends that have completed (a query that does not block), so their tensors are freed
        as soon as they are delivered rather than at the flush. A channel's sends complete in the order
        they were posted (one stream per group and peer, NCCL_MODEL.md rule 1), so each channel is
        queried from its oldest send to the first still in flight: a query per channel and per delivered
        send, however many are in flight (with every send queried, an iteration's queries grew as N^2)."""
        for queue in self.sends.values():
            while queue and self.t.p2p.done(queue[0][0]):
                work, _, a = queue.popleft()
                self._delivered(work, a)

    def in_flight(self) -> list[torch.Tensor]:
        return [tensor for queue in self.sends.values() for _, tensor, _ in queue]

    def take(self, message: tuple) -> torch.Tensor:
        """The input a compute action needs: its posted receive (waited for now) or a local output."""
        if message not in self.posted:  # from a stage on this worker: a leaf of its own, as if sent
            return self.kept.pop(message).detach()
        work, buf, a = self.posted.pop(message)
        try:
            self.t.p2p.wait(work)
        except RuntimeError as e:  # the peer died or the timeout passed
            raise PipelineFault(f"rank {dist.get_rank()} (worker {self.t.worker}) waited for the "
                                f"{_describe(a, self.t)}: {_first_line(e)}", action=a) from None
        return buf.to(self.t.device)

    def drain(self) -> None:
        for queue in self.sends.values():
            for work, _, a in queue:
                self._delivered(work, a)
        self.sends.clear()

    def _delivered(self, work, a: Action) -> None:
        try:
            self.t.p2p.wait(work)
        except RuntimeError as e:
            raise PipelineFault(f"rank {dist.get_rank()} (worker {self.t.worker}) could not deliver the "
                                f"{_describe(a, self.t)}: {_first_line(e)}", action=a) from None


def _describe(a: Action, t: Transport) -> str:
    what = "activation" if a.kind == "act" else "gradient"
    return (f"{what} of micro-batch {a.mb}, pipeline {a.pipeline}, stage {a.stage} "
            f"{'to' if a.op is Op.SEND else 'from'} worker {a.peer} (rank {t.ranks[a.peer]}) on group {a.group} "
            f"for {'F' if a.kind == 'act' else 'B'}{a.mb}p{a.pipeline}s{a.stage}")


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _raised(e: Exception) -> str:
    """The exception's type and first line: the type tells an out-of-memory error or a shape mismatch apart."""
    return f"{type(e).__name__}: {_first_line(e)}"


_WHAT = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_INPUT: "input-gradient backward",
         Op.BACKWARD_WEIGHT: "weight-gradient backward", Op.OVERLAPPED: "overlapped forward and backward"}


def _action_fault(a: Action, e: Exception, t: Transport, grad_sync: GradSync) -> PipelineFault:
    """The fault for ``e``, raised by ``a`` itself, not by one of its waits (those raise their own): a
    collective failure when a communication call raised it (posting a send or a receive, starting a
    reduction, a tensor-parallel collective inside a forward), else a ComputeFault naming the action."""
    who, what = f"rank {dist.get_rank()} (worker {t.worker})", _action_name(a, t)
    if raised_by_communication(e, (grad_sync,)):
        return PipelineFault(f"{who}: a collective failed in {what}: {_first_line(e)}", action=a)
    return ComputeFault(f"{who}: {what} raised {_raised(e)}", action=a)


def _action_name(a: Action | Overlapped, t: Transport) -> str:
    if a.op is Op.OVERLAPPED:
        f, b = a.parts
        return (f"the {_WHAT[a.op]} of micro-batches {f.mb} (pipeline {f.pipeline}, stage {f.stage}) and {b.mb} "
                f"(pipeline {b.pipeline}, stage {b.stage}) ({a})")
    if a.op in COMPUTE_OPS:
        return f"the {_WHAT[a.op]} of micro-batch {a.mb}, pipeline {a.pipeline}, stage {a.stage} ({a})"
    if a.op is Op.ALLREDUCE:
        return f"the gradient all-reduce of pipeline {a.pipeline}, stage {a.stage} on group {a.group} ({a})"
    return f"posting the {'send' if a.op is Op.SEND else 'receive'} of the {_describe(a, t)}"


def _ranges(a: Action, nvtx: bool) -> AbstractContextManager:
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


def _located(fault: PipelineFault, actions: Sequence[Action], at: int | None) -> PipelineFault:
    """``fault`` with the lowered list around ``actions[at]``, the action the worker was running; with
    ``at`` None (the flush, after the last action), around the send that failed. The headline stays
    the first line: the trainer and the tests read it."""
    flush = at is None
    if flush:
        at = actions.index(fault.action)
    where = f"at the flush, waiting for action {at}" if flush else f"at action {at}"
    return type(fault)(fault.headline, "\n".join([f"the worker's lowered list ({len(actions)} actions), {where}:",
                                                  *_around(actions, at)]), fault.action)


def _around(actions: Sequence[Action], at: int, width: int = 3) -> list[str]:
    """``width`` actions either side of ``actions[at]``, one a line with its index, ``at`` marked ``>>``."""
    digits = len(str(len(actions) - 1))
    return [f"{'>>' if i == at else '  '} {i:>{digits}} {actions[i]}"
            for i in range(max(0, at - width), min(len(actions), at + width + 1))]


def _scaled_loss(outputs, num_microbatches: int, per_token: bool):
    """megatron-core's loss_func conventions: (loss, num_tokens, report) or (loss, report)."""
    if len(outputs) == 3:
        loss, num_tokens, report = outputs
        if per_token:  # summed over tokens; the trainer divides by the global batch's token count
            return loss, report
        loss = loss / num_tokens
    else:
        loss, report = outputs
    return loss / num_microbatches, report


def make_forward_backward(lowered: Schedule, transport: Transport, grad_sync: GradSync,
                          observer: Observer | None = None, nvtx_ranges: bool = False,
                          schedule_plans: bool = False) -> Callable:
    """A function with megatron-core 0.19's forward_backward keyword signature. ``model`` and
    ``data_iterator`` are lists aligned with ``lowered.held(worker)`` (one chunk per stage copy);
    a data iterator yields its chunk's micro-batches in the order the schedule runs them (None where a
    chunk needs no data). Returns the loss reports of the micro-batches whose last stage is here.
    ``observer`` (the Observer protocol), when given, sees every action as it is posted and every
    compute action's device time after the flush. ``nvtx_ranges`` (--nvtx-ranges) adds an NVTX range
    per action when the device is a GPU (there is no NVTX on the CPU). ``schedule_plans`` runs training's
    forwards and backwards through schedule plans (the module's docstring); a schedule with overlapped
    actions needs it. megatron-core's options that this executor does not implement are refused when set,
    not ignored."""
    if any(a.op in (Op.SEND, Op.RECV, Op.ALLREDUCE) and a.batch >= 0 for w in lowered.workers for a in w):
        raise NotImplementedError("batched communication can be checked (validate --comm) but not executed yet")
    if not schedule_plans and any(a.op is Op.OVERLAPPED for w in lowered.workers for a in w):
        raise ValueError("a schedule with overlapped forwards and backwards runs its chunks through schedule "
                         "plans: pass schedule_plans=True")
    nvtx = nvtx_ranges and transport.device.type == "cuda"
    held = lowered.held(transport.worker)
    plans = {False: lowered.workers[transport.worker], True: forward_only(lowered).workers[transport.worker]}

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
        run = _Run(lowered, transport, dict(zip(held, chunks)), dict(zip(held, iterators)), forward_step_func,
                   _activation_shape(chunks[0].config, seq_length, micro_batch_size), num_microbatches, forward_only,
                   Clock(transport.device, enabled=observer is not None), schedule_plans and not forward_only)
        return run.execute(plans[forward_only], grad_sync, observer, nvtx)

    return forward_backward


def _refuse_unimplemented(**options) -> None:
    """megatron-core's forward_backward options this executor does not implement, when set."""
    given = [name for name, value in options.items() if value not in (None, False)]
    if given:
        raise NotImplementedError(f"the schedule executor does not implement {', '.join(given)} "
                                  "(megatron-core's forward_backward options)")


def _activation_shape(config, seq_length: int, micro_batch_size: int) -> tuple:
    """[sequence, batch, hidden] between stages; with sequence parallelism each tensor-parallel rank
    holds its 1/TP of the sequence, as in megatron-core's schedules."""
    if config.sequence_parallel:
        seq_length //= config.tensor_model_parallel_size
    return (seq_length, micro_batch_size, config.hidden_size)


@dataclass
class _Saved:
    """What one micro-batch's forward through one stage copy leaves for its backward: the stage input
    (a leaf; None on a first stage), the output (on a last stage the scaled loss, or, through a plan, the
    detached output the loss was computed from, with ``loss``), where a split backward's I stops
    (``boundary``), and the schedule plan it ran through."""

    x: torch.Tensor | None
    output: torch.Tensor
    boundary: torch.Tensor | None = None
    plan: object = None
    loss: torch.Tensor | None = None


class _Run:
    """The state of one call: chunks, data, messages, saved activations, loss reports. ``plans``: run the
    chunks through schedule plans (training only)."""

    def __init__(self, schedule, transport, chunk, data, forward_step_func, shape, num_microbatches, forward_only,
                 clock: Clock, plans: bool = False):
        self.s, self.t, self.chunk, self.data = schedule, transport, chunk, data
        self.forward_step_func, self.num_microbatches = forward_step_func, num_microbatches
        self.forward_only, self.plans = forward_only, plans
        self.clock = clock
        self.messages = _Messages(transport, shape, release_sent=not plans)
        self.per_token = getattr(next(iter(chunk.values())).config, "calculate_per_token_loss", False)
        self.last = schedule.stages_per_pipeline - 1
        self.saved: dict[tuple, _Saved] = {}
        self.weight_passes: dict[tuple, object] = {}
        self.reports = []
        self.embedded: dict[tuple, torch.Tensor] = {}  # a first stage's embedding output, the I boundary
        self.hooks = [self._watch_embedding(key, c) for key, c in chunk.items()
                      if key[1] == 0 and not forward_only and not plans and schedule.split_backward]

    def _watch_embedding(self, key, chunk):
        embedding = getattr(chunk, "embedding", None)  # megatron-core's GPTModel
        if embedding is None:
            return None
        return embedding.register_forward_hook(lambda _m, _i, out: self.embedded.__setitem__(key, out))

    def close(self) -> None:
        for h in self.hooks:
            if h is not None:
                h.remove()

    def execute(self, actions, grad_sync: GradSync, observer: Observer | None, nvtx: bool = False) -> list:
        """Run this worker's list, each action in its profiler range (``_ranges``); the flush waits for
        every send and, in training, every reduction. A PipelineFault shows where in the list it came
        (``_located``). The observer's action times are read after the flush, once."""
        timeline, at = [], None
        self.clock.begin()
        try:
            with torch.no_grad() if self.forward_only else torch.enable_grad():
                for at, a in enumerate(actions):
                    with _ranges(a, nvtx):
                        ran = self.step(a, grad_sync)
                    if ran is not None:
                        timeline.append((a, ran, self.clock.stamp()))
                    if observer is not None:
                        observer.after_action(a, self.held)
            at = None  # the flush
            self.messages.drain()
        except PipelineFault as fault:
            raise _located(fault, actions, at) from fault.__cause__
        finally:
            self.close()
        if not self.forward_only:
            self._finish(grad_sync)
        if observer is not None:
            self._report(timeline, observer)
        return self.reports

    def _finish(self, grad_sync: GradSync) -> None:
        """The flush's reductions (GradSync.finish): a failure there is a collective's."""
        try:
            grad_sync.finish()
        except RuntimeError as e:
            raise PipelineFault(f"rank {dist.get_rank()} (worker {self.t.worker}): a collective failed at the "
                                f"flush, completing the gradient reductions: {_first_line(e)}") from e

    def _report(self, timeline: list, observer: Observer) -> None:
        seconds = self.clock.seconds([stamp for _, start, end in timeline for stamp in (start, end)])
        for i, (a, _, _) in enumerate(timeline):
            observer.on_action(a, seconds[2 * i], seconds[2 * i + 1])

    def held(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this run holds now, by why (the Observer protocol's ``held``)."""
        m = self.messages
        return {"receive buffers": [buf for _, buf, _ in m.posted.values()],
                "unsent": list(m.kept.values()) + list(self.embedded.values()),
                "in flight": m.in_flight(),
                "stage inputs": [t for s in self.saved.values() for t in (s.x, s.output, s.boundary) if t is not None],
                "kept for W": [g for w in self.weight_passes.values() for g in w.kept()]}

    def step(self, a: Action, grad_sync: GradSync):
        """Post or run one action; a compute action returns the stamp of its start. What the action
        raises itself becomes a fault naming it (``_action_fault``); its waits raise their own."""
        try:
            started = self._act(a, grad_sync)
        except PipelineFault:
            raise
        except Exception as e:  # a RuntimeError (CUDA, out of memory) or any bug in a forward or backward
            raise _action_fault(a, e, self.t, grad_sync) from e
        self.messages.reap()
        return started

    def _act(self, a: Action, grad_sync: GradSync) -> float | None:
        """A compute action's start stamp; None for a post."""
        if a.op is Op.RECV:
            return self.messages.receive(a)
        if a.op is Op.SEND:
            return self.messages.send(a)
        if a.op is Op.ALLREDUCE:
            return grad_sync.start(a.pipeline, a.stage, self.t.groups[a.group])
        return {Op.FORWARD: self.forward, Op.BACKWARD: self.backward, Op.BACKWARD_INPUT: self.backward,
                Op.BACKWARD_WEIGHT: self.backward_weight, Op.OVERLAPPED: self.overlapped}[a.op](a)

    def forward(self, a: Action) -> float:
        x = self._input(a)
        started = self.clock.stamp()  # compute only: waiting for the input is a bubble
        if self.plans:
            plan, loss_func = self._plan(a, x)
            self._keep_output(a, x, type(plan).run(plan, None), loss_func, plan)
        else:
            key = (a.pipeline, a.stage)
            self.chunk[key].set_input_tensor(x)
            self._keep_output(a, x, *self.forward_step_func(self.data[key], self.chunk[key]))
        return started

    def backward(self, a: Action) -> float:
        """B, or I (the input gradient now, the weight gradients at the same micro-batch's W)."""
        saved = self.saved.pop((a.pipeline, a.stage, a.mb))
        grad = self._output_grad(a, saved)
        started = self.clock.stamp()
        if self.plans:
            type(saved.plan).run(None, saved.plan, b_grad=self._plan_backward(a, saved, grad))
            dx = saved.x.grad if saved.x is not None else None
        elif a.op is Op.BACKWARD:
            torch.autograd.backward(graph_root(saved.output) if grad is not None else saved.output, grad_tensors=grad)
            dx = saved.x.grad if saved.x is not None else None
        else:
            params = [p for p in self.chunk[(a.pipeline, a.stage)].parameters() if p.requires_grad]
            dx, self.weight_passes[(a.pipeline, a.stage, a.mb)] = backward_input(saved.output, grad, saved.boundary,
                                                                                params)
        self._keep_input_grad(a, dx)
        return started

    def overlapped(self, a: Overlapped) -> float:
        """F&B: one micro-batch's forward beside another's B or I, interleaved part by part by their
        schedule plans (megatron-core's combined 1F1B)."""
        f, b = a.parts
        x = self._input(f)
        saved = self.saved.pop((b.pipeline, b.stage, b.mb))
        grad = self._output_grad(b, saved)
        started = self.clock.stamp()
        plan, loss_func = self._plan(f, x)
        output = type(plan).run(plan, saved.plan, b_grad=self._plan_backward(b, saved, grad))
        self._keep_output(f, x, output, loss_func, plan)
        self._keep_input_grad(b, saved.x.grad if saved.x is not None else None)
        return started

    def backward_weight(self, a: Action) -> float:
        started = self.clock.stamp()
        self.weight_passes.pop((a.pipeline, a.stage, a.mb)).run()
        return started

    def _input(self, a: Action) -> torch.Tensor | None:
        """A forward's input: the previous stage's activation, a leaf (None on a first stage)."""
        if a.stage == 0:
            return None
        x = self.messages.take(consumed_messages(self.s, a)[0])
        return x.requires_grad_(not self.forward_only)  # arrives in the transport dtype

    def _plan(self, a: Action, x: torch.Tensor | None):
        """The micro-batch's schedule plan and loss function (megatron-core's forward_step convention)."""
        key = (a.pipeline, a.stage)
        self.chunk[key].set_input_tensor(x)
        return self.forward_step_func(self.data[key], self.chunk[key], return_schedule_plan=True)

    def _keep_output(self, a: Action, x, output, loss_func, plan=None) -> None:
        """A forward's output: kept for its send (or the local next stage), and with the stage input for
        the backward; on a last stage the loss computed from it, whose report is kept."""
        loss = None
        if a.stage == self.last:
            if plan is not None:  # the plan's backward starts from the gradient of its own output
                output = output.detach().requires_grad_(not self.forward_only)
            loss, report = _scaled_loss(loss_func(output), self.num_microbatches, self.per_token)
            self.reports.append(report)
            if plan is None:
                output, loss = loss, None
        else:
            self.messages.keep(produced_messages(self.s, a)[0], output)
        if not self.forward_only:
            boundary = self.embedded.pop((a.pipeline, a.stage), None) if a.stage == 0 else x
            self.saved[(a.pipeline, a.stage, a.mb)] = _Saved(x, output, boundary, plan, loss)

    def _output_grad(self, a: Action, saved: _Saved) -> torch.Tensor | None:
        """A backward's incoming gradient: the next stage's, received (None on a last stage)."""
        if a.stage == self.last:
            return None
        return self.messages.take(consumed_messages(self.s, a)[0]).to(saved.output.dtype)

    def _plan_backward(self, a: Action, saved: _Saved, grad: torch.Tensor | None) -> torch.Tensor:
        """What a plan's backward starts from (on a last stage, the loss's gradient of the plan's output);
        for an I, the plan is told to leave its weight gradients to the W."""
        if saved.loss is not None:
            torch.autograd.backward(saved.loss)
            grad = saved.output.grad
        if a.op is Op.BACKWARD_INPUT:
            self.weight_passes[(a.pipeline, a.stage, a.mb)] = saved.plan.defer_weight_gradients()
        return grad

    def _keep_input_grad(self, a: Action, dx: torch.Tensor | None) -> None:
        if a.stage > 0:
            self.messages.keep(produced_messages(self.s, a)[0], dx)
