"""Run any schedule of the IR on real processes, as a megatron-core forward_backward function.

The executor walks this worker's action list and knows nothing of which schedule made it:
- F: receive the input from the previous stage's worker (or take it locally), run
  ``forward_step_func`` on the chunk, compute the loss on the last stage, send the output on.
- B: backward from the loss or from the received output gradient, send the input gradient back.
- R: hand the chunk's gradients to ``GradSync.start`` (an asynchronous all-reduce); the flush
  (``GradSync.finish``) waits for every reduction before the function returns.

Sends never block. Receives are matched in the order the sender issued its sends on each channel
(peer pair and pipeline): when a later message is needed first, the earlier ones are received and
buffered. That is how both gloo (matching by order and tag) and NCCL (matching by order) see it, and
with non-blocking sends it cannot deadlock on any schedule the validator accepts.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from .ir import Op, Schedule


class PipelineFault(RuntimeError):
    """A peer died or stopped answering: names the rank, the message it waited for and the peer."""


class GradSync(Protocol):
    def start(self, pipeline: int, stage: int) -> None:
        """Begin reducing the gradients of this stage copy over its replica group."""

    def finish(self) -> None:
        """Complete every reduction started this iteration (and any that span several copies)."""


@dataclass(frozen=True)
class Transport:
    """Where this worker's peers are. ``ranks[w]`` is the global rank of worker w (same data- and
    tensor-parallel position); ``groups[p]`` the process group of pipeline p (None: the default).
    ``comm_device`` stages p2p through another device, e.g. host memory for gloo with CUDA tensors.
    ``timeout``: how long one p2p operation may wait for its peer (a blocking gloo recv never times
    out by itself: a silent peer would hang this rank for good)."""

    worker: int
    ranks: Sequence[int]
    groups: Sequence[object]
    device: torch.device
    dtype: torch.dtype
    comm_device: torch.device | None = None  # where p2p buffers live (host staging: CPU); default: device
    timeout: timedelta = timedelta(minutes=10)


def _messages(schedule: Schedule, forward_only: bool):
    """Every p2p message of one iteration, per channel (src, dst, pipeline), in the sender's order.
    A message is ("act" | "grad", pipeline, receiving stage, micro-batch)."""
    last = schedule.stages_per_pipeline - 1
    channels: dict[tuple[int, int, int], deque] = {}
    for src, actions in enumerate(schedule.workers):
        for a in actions:
            if a.op is Op.FORWARD and a.stage < last:
                kind, stage = "act", a.stage + 1
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and a.stage > 0 and not forward_only:
                kind, stage = "grad", a.stage - 1
            else:
                continue
            dst = schedule.placement[a.pipeline][stage]
            if dst != src:
                channels.setdefault((src, dst, a.pipeline), deque()).append((kind, a.pipeline, stage, a.mb))
    return channels


class _Mailbox:
    """One iteration's p2p state. ``expected``: per incoming channel, the messages in the sender's order."""

    def __init__(self, transport: Transport, shape: tuple, expected: dict):
        self.t, self.shape = transport, shape
        self.expected = {k: deque(v) for k, v in expected.items()}
        self.arrived: dict[tuple, torch.Tensor] = {}
        self.local: dict[tuple, torch.Tensor] = {}
        self.sends: list = []  # (work, tensor kept alive until sent, destination worker, message)

    def send(self, tensor: torch.Tensor, dst_worker: int, message: tuple) -> None:
        if dst_worker == self.t.worker:
            self.local[message] = tensor
            return
        tensor = tensor.detach().to(self.t.comm_device or self.t.device, self.t.dtype).contiguous()
        group = self.t.groups[message[1]]
        self.sends.append((dist.isend(tensor, self.t.ranks[dst_worker], group=group), tensor, dst_worker, message))

    def receive(self, src_worker: int, message: tuple) -> torch.Tensor:
        if src_worker == self.t.worker:
            return self.local.pop(message)
        channel = (src_worker, self.t.worker, message[1])
        while message not in self.arrived:
            nxt = self.expected[channel].popleft()
            buf = torch.empty(self.shape, dtype=self.t.dtype, device=self.t.comm_device or self.t.device)
            try:
                dist.irecv(buf, self.t.ranks[src_worker], group=self.t.groups[message[1]]).wait(self.t.timeout)
            except RuntimeError as e:  # the peer died or the timeout passed
                raise PipelineFault(f"rank {dist.get_rank()} (worker {self.t.worker}) waited for the "
                                    f"{_describe(message, src_worker, self.t)}: {_first_line(e)}") from None
            self.arrived[nxt] = buf.to(self.t.device)
        return self.arrived.pop(message)

    def drain(self) -> None:
        for work, _, dst_worker, message in self.sends:
            try:
                work.wait(self.t.timeout)
            except RuntimeError as e:
                raise PipelineFault(f"rank {dist.get_rank()} (worker {self.t.worker}) could not deliver the "
                                    f"{_describe(message, dst_worker, self.t, to=True)}: {_first_line(e)}") from None
        self.sends.clear()


def _describe(message: tuple, peer: int, t: Transport, to: bool = False) -> str:
    kind, pipeline, stage, mb = message
    what = "activation" if kind == "act" else "gradient"
    return (f"{what} of micro-batch {mb}, pipeline {pipeline}, stage {stage} {'to' if to else 'from'} worker {peer} "
            f"(rank {t.ranks[peer]}) for {'F' if kind == 'act' else 'B'}{mb}p{pipeline}s{stage}")


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _scaled_loss(outputs, num_microbatches: int, per_token: bool):
    """megatron-core's loss_func conventions: (loss, num_tokens, report) or (loss, report)."""
    if len(outputs) == 3:
        loss, num_tokens, report = outputs
        if not per_token:
            loss = loss / num_tokens
    else:
        loss, report = outputs
    return loss / num_microbatches, report


def make_forward_backward(schedule: Schedule, transport: Transport, grad_sync: GradSync,
                          tracer: Callable | None = None) -> Callable:
    """A function with megatron-core 0.16.1's forward_backward keyword signature. ``model`` and
    ``data_iterator`` are lists aligned with ``schedule.held(worker)`` (one chunk per stage copy);
    a data iterator yields its chunk's micro-batches in the order the schedule runs them (None where a
    chunk needs no data). Returns the loss reports of the micro-batches whose last stage is here.
    ``tracer(action, start, end)``, when given, is called after every F and B with perf_counter times
    (the benchmark measures bubbles from these)."""
    if any(a.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) for w in schedule.workers for a in w):
        raise NotImplementedError("split backward (I/W actions) is in the IR but not executed yet")
    held = schedule.held(transport.worker)
    last = schedule.stages_per_pipeline - 1
    incoming = {mode: {k: v for k, v in _messages(schedule, mode).items() if k[1] == transport.worker}
                for mode in (False, True)}  # keyed by forward_only

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                         micro_batch_size, decoder_seq_length=None, forward_only=False,
                         collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
                         p2p_communicator=None, pg_collection=None, force_all_reduce=False):
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        iterators = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]
        if len(chunks) != len(held) or len(iterators) != len(held):
            raise ValueError(f"worker {transport.worker} holds {len(held)} stage copies {held}; got "
                             f"{len(chunks)} model chunks and {len(iterators)} data iterators")
        if num_microbatches != schedule.microbatches:
            raise ValueError(f"schedule has {schedule.microbatches} micro-batches, called with {num_microbatches}")
        chunk = dict(zip(held, chunks))
        data = dict(zip(held, iterators))
        config = chunks[0].config
        shape = (seq_length, micro_batch_size, config.hidden_size)
        mail = _Mailbox(transport, shape, incoming[forward_only])
        per_token = getattr(config, "calculate_per_token_loss", False)
        saved: dict[tuple, tuple] = {}
        reports = []
        grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
        with grad_mode:
            for a in schedule.workers[transport.worker]:
                key = (a.pipeline, a.stage)
                if a.op is Op.FORWARD:
                    x = None
                    if a.stage > 0:
                        x = mail.receive(schedule.placement[a.pipeline][a.stage - 1], ("act", *key, a.mb))
                        x.requires_grad_(not forward_only)  # arrives in the transport dtype
                    started = time.perf_counter()  # compute only: waiting for the input is a bubble
                    chunk[key].set_input_tensor(x)
                    output, loss_func = forward_step_func(data[key], chunk[key])
                    if a.stage == last:
                        output, report = _scaled_loss(loss_func(output), num_microbatches, per_token)
                        reports.append(report)
                    else:
                        mail.send(output, schedule.placement[a.pipeline][a.stage + 1], ("act", a.pipeline, a.stage + 1, a.mb))
                    if not forward_only:
                        saved[(*key, a.mb)] = (x, output)
                elif a.op is Op.BACKWARD and not forward_only:
                    x, output = saved.pop((*key, a.mb))
                    grad = None
                    if a.stage < last:
                        grad = mail.receive(schedule.placement[a.pipeline][a.stage + 1], ("grad", *key, a.mb))
                        grad = grad.to(output.dtype)
                    started = time.perf_counter()
                    torch.autograd.backward(output, grad_tensors=grad)
                    if a.stage > 0:
                        mail.send(x.grad, schedule.placement[a.pipeline][a.stage - 1], ("grad", a.pipeline, a.stage - 1, a.mb))
                else:
                    if a.op is Op.REDUCE_GRADS and not forward_only:
                        grad_sync.start(*key)
                    continue
                if tracer is not None:
                    tracer(a, started, time.perf_counter())
        mail.drain()
        if not forward_only:
            grad_sync.finish()
        return reports

    return forward_backward
