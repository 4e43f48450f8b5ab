"""What failed in an iteration's pipeline, and whose fault it was.

A PipelineFault names the action the worker was at, in the lowered list around it. What failed is told by
where it was raised, not by its text: a communication call (a wait, a post, a reduction, a collective
inside a forward) is a collective failure; anything else a forward or backward raises is a ComputeFault,
this worker's own error, naming the action and keeping the original exception as its cause.
"""
from __future__ import annotations

import traceback
from collections.abc import Sequence

import torch.distributed as dist

from ..ir.actions import COMPUTE_OPS, Action, Op, Overlapped
from ..ir.channels import EMBEDDING_GROUP, reduces


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
        fault = PipelineFault(f"{who}: a collective failed: {first_line(e)}")
    else:
        fault = ComputeFault(f"{who}: {where} failed: {_raised(e)}")
    fault.__cause__ = e
    return fault


def action_fault(a: Action | Overlapped, e: Exception, worker: int, ranks: Sequence[int],
                 helpers: tuple = ()) -> PipelineFault:
    """The fault for ``e``, raised by ``a`` itself, not by one of its waits (those raise their own): a
    collective failure when a communication call raised it (posting a send or a receive, starting a
    reduction, a tensor-parallel collective inside a forward; ``helpers`` as in
    ``raised_by_communication``), else a ComputeFault naming the action."""
    who, what = worker_name(worker), _action_name(a, ranks)
    if raised_by_communication(e, helpers):
        return PipelineFault(f"{who}: a collective failed in {what}: {first_line(e)}", action=a)
    return ComputeFault(f"{who}: {what} raised {_raised(e)}", action=a)


def located(fault: PipelineFault, actions: Sequence[Action | Overlapped], at: int | None) -> PipelineFault:
    """``fault`` with the lowered list around ``actions[at]``, the action the worker was running; with
    ``at`` None (the flush, after the last action), around the send that failed. The headline stays
    the first line: the trainer and the tests read it."""
    flush = at is None
    if flush:
        at = actions.index(fault.action)
    where = f"at the flush, waiting for action {at}" if flush else f"at action {at}"
    return type(fault)(fault.headline, "\n".join([f"the worker's lowered list ({len(actions)} actions), {where}:",
                                                  *_around(actions, at)]), fault.action)


def worker_name(worker: int) -> str:
    """How a headline names this process: its global rank and its worker in the schedule."""
    return f"rank {dist.get_rank()} (worker {worker})"


def describe_message(a: Action, ranks: Sequence[int]) -> str:
    """The message a SEND or RECV carries, its peer and the compute action that needs it."""
    what = "activation" if a.kind == "act" else "gradient"
    return (f"{what} of micro-batch {a.mb}, pipeline {a.pipeline}, stage {a.stage} "
            f"{'to' if a.op is Op.SEND else 'from'} worker {a.peer} (rank {ranks[a.peer]}) on group {a.group} "
            f"for {'F' if a.kind == 'act' else 'B'}{a.mb}p{a.pipeline}s{a.stage}")


def first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _raised(e: Exception) -> str:
    """The exception's type and first line: the type tells an out-of-memory error or a shape mismatch apart."""
    return f"{type(e).__name__}: {first_line(e)}"


_WHAT = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_INPUT: "input-gradient backward",
         Op.BACKWARD_WEIGHT: "weight-gradient backward", Op.OVERLAPPED: "overlapped forward and backward",
         Op.HALVED: "in halves"}


def _action_name(a: Action | Overlapped, ranks: Sequence[int]) -> str:
    if a.op is Op.OVERLAPPED:
        f, b = a.parts
        return (f"the {_WHAT[a.op]} of micro-batches {f.mb} (pipeline {f.pipeline}, stage {f.stage}) and {b.mb} "
                f"(pipeline {b.pipeline}, stage {b.stage}) ({a})")
    if a.op is Op.HALVED:
        return f"{_action_name(a.action, ranks)[:-len(f' ({a.action})')]}, in two halves ({a})"
    if a.op in COMPUTE_OPS:
        return f"the {_WHAT[a.op]} of micro-batch {a.mb}, pipeline {a.pipeline}, stage {a.stage} ({a})"
    if a.op is Op.ALLREDUCE and a.group == EMBEDDING_GROUP:
        return f"the word embedding's gradient all-reduce on group {a.group} ({a})"
    if a.op is Op.ALLREDUCE:
        experts = "expert " if reduces(a.group) == "experts" else ""
        return f"the {experts}gradient all-reduce of pipeline {a.pipeline}, stage {a.stage} on group {a.group} ({a})"
    return f"posting the {'send' if a.op is Op.SEND else 'receive'} of the {describe_message(a, ranks)}"


def _around(actions: Sequence[Action | Overlapped], at: int, width: int = 3) -> list[str]:
    """``width`` actions either side of ``actions[at]``, one a line with its index, ``at`` marked ``>>``."""
    digits = len(str(len(actions) - 1))
    return [f"{'>>' if i == at else '  '} {i:>{digits}} {actions[i]}"
            for i in range(max(0, at - width), min(len(actions), at + width + 1))]
