"""An emulated mixture-of-experts stage: its forward and backward run as megatron-core's combined-1F1B
schedule plan, part by part, so that our executor can overlap one micro-batch's all-to-all with
another's compute (``--a2a-fraction``).

Each pass is the parts of chimera_schedules/ir/parts.py at the stage's own times (``stage_parts``, the
numbers the simulator prices): per MoE layer attention and experts (compute), dispatch and combine
(the all-to-all). The all-to-all is a timed wait on a communication thread, not a gloo all-to-all of
the tokens: this machine's two cores would make a real one cost what they are busy with, not what the
profile's interconnect says. Compute parts are timed waits on the calling thread (the stream the
executor drives), all-to-all parts timed waits on one communication thread per process (a queue
worker). Each part starts when its stream is free and the previous part of its own micro-batch has
ended, ``parts.timeline``'s rule in real time: a part's start is the later of those two recorded ends,
its end the moment its wait returns, so a late wake-up delays what follows, and a thread's hand-off
costs nothing as long as the part outlasts it. The executor gives the parts their order: a plan run
alone is its pass's parts one after another, two plans run together (an overlapped F&B action) are
``parts.interleave`` of both, the two halves of one micro-batch (a halved action, ``run_halves``)
``parts.halves`` of its pass.

A halved action's compute runs at ``HALVES_EFFICIENCY`` of its rate (set per run: the split the
micro-batch size takes, priced as the simulator prices it, ``CostModel.halves_efficiency``).

Contention (``CONTENTION``, set per case): a compute part progresses at 1 / (1 + CONTENTION) of its
rate while an all-to-all part runs on the communication thread, checked every ``_SLICE`` seconds, as
``parts.timeline`` prices it.

Every compute part is recorded in ``stage.SPANS`` (the bubble counts them) and every part in ``PARTS``,
from which ``a2a_overlap`` measures how much all-to-all ran inside the compute of another chain (the
other micro-batch, or the other half).
"""
from __future__ import annotations

import ctypes
import itertools
import queue
import statistics
import sys
import threading
import time

import torch
from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan

from chimera_schedules.ir import parts

from . import stage
from .stage import EmulatedStage, StageTimes

ATTENTION_SHARE = 0.5  # of a layer's compute, its attention part (the rest its experts): the simulator's too
PARTS: list[tuple[int, tuple, str, float, float]] = []  # (run, part's chain, stream, start, end) of every part
CONTENTION = 0.0  # compute's slowdown while an all-to-all runs beside it
HALVES_EFFICIENCY = 1.0  # a halved action's compute rate for its size (parts.halves), set per run
_SLICE = 0.0005  # how often a compute part under contention looks at the communication thread
_RUNS = itertools.count()
_PR_SET_TIMERSLACK = 29


def _precise_timers() -> None:
    """Linux lets a sleeping thread wake up to 50 us late by default; a pass here is dozens of waits
    (four parts per layer), and each one's lateness delays the next, so this thread's slack is set to
    1 ns (about 40 us late instead of 90 here)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)


def stage_parts(times: StageTimes, role: str, compute: float) -> list[parts.Part]:
    """A pass's parts through a stage: ``role`` "F" (forward) or "B" (a backward or an I) computing for
    ``compute`` seconds. A stage without MoE layers (DeepSeek-V3's first, dense ones) is one layer whose
    all-to-alls take no time."""
    make = parts.forward_parts if role == "F" else parts.backward_parts
    return make(compute, times.a2a, max(1, times.moe_layers), ATTENTION_SHARE)


class _Job:
    """One part issued in one run: it may start once ``after`` (its chain's previous part) ended."""

    def __init__(self, part: parts.Part, after: _Job | None, ready: float, run: int, label: str):
        self.part, self.after, self.ready, self.run, self.label = part, after, ready, run, label
        self.end, self.done = 0.0, threading.Event()

    def execute(self, stream_free: float) -> float:
        """Waits for its chain's previous part, then is busy for its time after the later of that
        part's end and its stream's; records itself and returns its end."""
        if self.after is not None:
            self.after.done.wait()
        start = max(stream_free, self.after.end if self.after is not None else self.ready)
        if self.part.stream == parts.COMM:
            _COMM[0].busy_until = start + self.part.time
            _sleep_until(start + self.part.time)
        else:
            _compute(start, self.part.time)
        self.end = time.perf_counter()
        if self.part.stream == parts.COMPUTE:
            stage.SPANS.append((self.label, start, self.end))
        PARTS.append((self.run, self.part.chain, self.part.stream, start, self.end))
        self.done.set()
        return self.end


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


def _compute(start: float, work: float) -> None:
    """Busy with ``work`` seconds of compute from ``start``: at full rate, or under ``CONTENTION`` at
    1 / (1 + CONTENTION) of it while the communication thread runs an all-to-all."""
    if CONTENTION <= 0:
        _sleep_until(start + work)
        return
    now = start
    while work > 1e-9:
        busy = _COMM[0].busy_until > now
        rate = 1 / (1 + CONTENTION) if busy else 1.0
        _sleep_until(now + min(_SLICE, work / rate))
        later = time.perf_counter()
        work -= (later - now) * rate
        now = later


class _CommStream:
    """The process's communication thread: runs the all-to-all parts in the order they are issued."""

    def __init__(self):
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.free = self.busy_until = 0.0  # busy_until: the running all-to-all part's planned end
        threading.Thread(target=self._serve, name="emulated-a2a", daemon=True).start()

    def _serve(self) -> None:
        _precise_timers()
        while True:
            job = self.jobs.get()
            self.free = job.execute(self.free)


_COMM: list[_CommStream] = []  # started at the first run


def issue(order: list[parts.Part], labels: dict[str, str]) -> None:
    """Runs the parts of one plan run in ``order`` (compute here, all-to-all on the communication
    thread) and returns when all have ended. ``labels``: the pass each role's compute is recorded as
    in ``stage.SPANS`` (F, B or I)."""
    if not _COMM:
        _precise_timers()
        _COMM.append(_CommStream())
    run = next(_RUNS)
    base = compute_free = time.perf_counter()
    last: dict[tuple, _Job | None] = {}
    for part in order:
        if part.time <= 0:  # a dense stage's all-to-all
            continue
        job = last[part.chain] = _Job(part, last.get(part.chain), base, run, labels[part.role])
        if part.stream == parts.COMM:
            _COMM[0].jobs.put(job)
        else:
            compute_free = job.execute(compute_free)
    for job in last.values():
        if job is not None:
            job.done.wait()


def host_ms(times: StageTimes, rounds: int = 5) -> float:
    """What each issued part adds on this emulated device, in ms: one stage's halved forward issued
    ``rounds`` times, its time over ``parts.span`` of its parts divided by how many it issues (the median
    round). Every rank measures at once, as the cases run (late wake-ups grow with the threads sharing the
    cores); nothing it runs is recorded."""
    order = parts.halves(stage_parts(times, "F", times.forward))
    issued, over = sum(p.time > 0 for p in order), []
    for _ in range(rounds):
        start = time.perf_counter()
        issue(order, {"F": "F"})
        over.append((time.perf_counter() - start - parts.span(order)) / issued * 1e3)
    stage.SPANS.clear()
    PARTS.clear()
    return statistics.median(over)


def a2a_overlap() -> tuple[float, float]:
    """Seconds of all-to-all in ``PARTS``, and how many of them lie inside a compute part of another
    chain of the same run (the other micro-batch of a pair, the other half of a halved action)."""
    by_run: dict[int, list[tuple]] = {}
    for entry in PARTS:
        by_run.setdefault(entry[0], []).append(entry)
    total = inside = 0.0
    for entries in by_run.values():
        for _, chain, stream, start, end in entries:
            if stream != parts.COMM:
                continue
            total += end - start
            inside += sum(max(0.0, min(end, e) - max(start, s)) for _, c, st, s, e in entries
                          if st == parts.COMPUTE and c != chain)
    return total, inside


def _accumulate(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad + grad


class WeightPass:
    """A deferred weight-gradient pass (a split backward's W): the stage's W time on the calling
    thread, then the weight gradients."""

    def __init__(self, plan: SchedulePlan):
        self.plan = plan

    def run(self) -> None:
        start = time.perf_counter()
        deadline = start + self.plan.stage.device.times.weight * self.plan.share
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)
        stage.SPANS.append(("W", start, time.perf_counter()))
        self.plan.weight_gradients()

    def kept(self) -> list[torch.Tensor]:
        """What it holds for W, as an observer counts it: nothing beyond the plan's own tensors."""
        return []


class _Event:
    """What a megatron-core schedule node orders its streams with (``event.record``, ``event.wait``):
    here the parts order themselves (``issue``), so nothing."""

    def record(self, *_) -> None: ...

    def wait(self, *_) -> None: ...


class SchedulePlan(AbstractSchedulePlan):
    """One micro-batch's pass through a MoE stage, megatron-core's combined-1F1B protocol: ``run`` with
    a forward plan returns the stage's output; with a backward plan and the output's gradient it sets
    the input's gradient (``x.grad``) and, unless ``defer_weight_gradients`` was called (a split
    backward's I), the weights'. megatron-core's own combined 1F1B (its interleaved schedule with
    ``overlap_moe_expert_parallel_comm``) runs these plans too: it passes the callbacks that carry its
    p2p (``pre_forward`` ...), names the plan's model chunk (``vp_stage``) and computes a last stage's
    loss in a schedule node on the plan's ``event``."""

    def __init__(self, owner: MoEStage, x: torch.Tensor):
        self.stage, self.x, self.deferred, self.grad = owner, x, False, None
        self.share = 1.0  # of the micro-batch: a half's W waits half the stage's
        self.vp_stage, self.event = getattr(owner, "vp_stage", None), _Event()

    def defer_weight_gradients(self) -> WeightPass:
        self.deferred = True
        return WeightPass(self)

    def forward_parts(self) -> list[parts.Part]:
        return stage_parts(self.stage.device.times, "F", self.stage.device.times.forward)

    def backward_parts(self) -> list[parts.Part]:
        t = self.stage.device.times
        return stage_parts(t, "B", t.input if self.deferred else t.input + t.weight)

    @staticmethod
    def run(f_plan: SchedulePlan | None, b_plan: SchedulePlan | None, b_grad: torch.Tensor | None = None,
            pre_forward=None, pre_backward=None, post_forward=None, post_backward=None):
        """The forward of ``f_plan`` and the backward of ``b_plan`` (either may be None), their parts
        interleaved as megatron-core's combined 1F1B issues them; megatron-core's callbacks (its p2p)
        where its ``TransformerModelChunkSchedulePlan.run`` calls them."""
        if f_plan and pre_forward:
            pre_forward(f_plan.vp_stage)
        if b_plan and pre_backward:
            pre_backward(b_plan.vp_stage)
        order = parts.interleave(f_plan.forward_parts() if f_plan else [], b_plan.backward_parts() if b_plan else [])
        output = f_plan.output() if f_plan else None
        issue(order, {"F": "F", "B": "I" if b_plan and b_plan.deferred else "B"})
        if b_plan:
            b_plan.input_gradient(b_grad)
        if f_plan and post_forward:
            post_forward(output, f_plan.vp_stage)
        if b_plan and post_backward:
            post_backward(b_plan.x.grad, b_plan.vp_stage)
        return output

    def run_halves(self, second: SchedulePlan, grads: tuple[torch.Tensor, torch.Tensor] | None = None):
        """This plan and ``second``, the two halves of one micro-batch, run together (a halved action,
        ``parts.halves``): their forwards, returning both outputs, or with ``grads`` their backwards."""
        self.share = second.share = 0.5
        if grads is None:
            outputs = self.output(), second.output()
            issue(parts.halves(self.forward_parts(), HALVES_EFFICIENCY), {"F": "F"})
            return outputs
        issue(parts.halves(self.backward_parts(), HALVES_EFFICIENCY), {"B": "I" if self.deferred else "B"})
        for plan, grad in zip((self, second), grads):
            plan.input_gradient(grad)
        return None

    def output(self) -> torch.Tensor:
        """The stage's output: the input (a first stage's sample through its embedding) plus its weight;
        a leaf that asks for its gradient, which a last stage's loss flows back to (the plan's backward
        then starts from it, as megatron-core's loss node hands it on)."""
        with torch.no_grad():
            x = self.x if self.stage.embedding is None else self.x + self.stage.embedding.weight
            return (x + self.stage.weight).requires_grad_()

    def input_gradient(self, grad: torch.Tensor) -> None:
        """The input's gradient is the output's (the stage adds a vector); the weights' follow now or
        in the deferred weight pass."""
        self.grad = grad
        if self.x.requires_grad:
            _accumulate(self.x, grad.detach().contiguous().clone())
        if not self.deferred:
            self.weight_gradients()

    def weight_gradients(self) -> None:
        g = self.grad.detach().reshape(-1, self.grad.shape[-1]).sum(0)
        for p in self.stage.parameters():
            _accumulate(p, g)
        self.grad = None


class MoEStage(EmulatedStage):
    """An emulated stage whose MoE layers spend ``times.a2a`` in all-to-alls; our executor runs its
    passes as schedule plans (``stage.forward_step`` with ``return_schedule_plan``)."""

    def schedule_plan(self, x: torch.Tensor) -> SchedulePlan:
        """The micro-batch's plan; a first stage's ``x`` is its samples as loaded, batch first."""
        return SchedulePlan(self, x.transpose(0, 1) if self.embedding is not None else x)

    build_schedule_plan = schedule_plan  # what megatron-core's combined 1F1B looks for on a model chunk
