"""Lowering: a compute schedule becomes the list each worker posts, communication included.

Every cross-worker message becomes a SEND on its producer's worker and a RECV on its consumer's,
and every gradient reduction an ALLREDUCE, each naming its process group (channel):
- ``p{P}.act`` carries pipeline P's activations (to stage + 1), ``p{P}.grad`` its input gradients
  (to stage - 1): one group per direction and pipeline, so a large gradient never queues behind an
  activation on NCCL's per-pair stream (NCCL_MODEL.md rule 1);
- ``stage{S}`` is stage S's replica group (every copy, every data-parallel rank).

Posting order. The compute schedule is replayed once under fixed unit costs (``ORDER_COSTS``), which
gives every action and message a time. Each worker then posts its operations sorted by one global key:
a message at the time it is posted (both ends use the same key), a compute action at its start, an
all-reduce when the last copy of its stage is ready, ties broken the same way on every worker. So
both ends of every channel see its messages in the same order, and every group's members see its
collectives in the same order. Because the keys come from a run that finishes, the lists finish even
when every operation blocks until its partner arrives (``nccl-single-queue``); ``nccl_model.py``
checks that rather than trusting this argument.

Receives are posted ahead of need: a message's key is the time its producer finishes, so the
transfer overlaps whatever the receiver computes meanwhile. At most ``buffers`` receives are posted
ahead on a worker; a message beyond that is posted when a buffer frees (or just before it is needed),
its send moving with it so both ends keep the same key.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from .ir import Action, Op, Schedule
from .simulator import CostModel, replay

ORDER_COSTS = CostModel(forward=1.0, backward=2.0)  # for the posting order only, never for timing
RECV_BUFFERS = 3
_KIND_RANK = {"act": 0, "grad": 1}


def act_group(pipeline: int) -> str:
    return f"p{pipeline}.act"


def grad_group(pipeline: int) -> str:
    return f"p{pipeline}.grad"


def stage_group(stage: int) -> str:
    return f"stage{stage}"


@dataclass(frozen=True)
class Message:
    """One p2p message of an iteration. ``ready``: when its producer ends; ``needed``: when its
    consumer starts (in the order replay)."""

    kind: str
    pipeline: int
    stage: int  # the receiving stage
    mb: int
    src: int
    dst: int
    ready: float
    needed: float

    def action(self, op: Op) -> Action:
        peer = self.dst if op is Op.SEND else self.src
        group = act_group(self.pipeline) if self.kind == "act" else grad_group(self.pipeline)
        return Action(op, self.mb, self.pipeline, self.stage, peer, group, self.kind)

    def order(self, time: float) -> tuple:
        return (time, 0, self.src, self.dst, _KIND_RANK[self.kind], self.pipeline, self.stage, self.mb)


def produced_message(schedule: Schedule, action: Action) -> tuple[str, int, int, int] | None:
    """The message a compute action produces: (kind, pipeline, receiving stage, mb), or None."""
    last = schedule.stages_per_pipeline - 1
    if action.op is Op.FORWARD and action.stage < last:
        return ("act", action.pipeline, action.stage + 1, action.mb)
    if action.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and action.stage > 0:
        return ("grad", action.pipeline, action.stage - 1, action.mb)
    return None


def consumed_message(schedule: Schedule, action: Action) -> tuple[str, int, int, int] | None:
    """The message a compute action needs before it can start, or None."""
    last = schedule.stages_per_pipeline - 1
    if action.op is Op.FORWARD and action.stage > 0:
        return ("act", action.pipeline, action.stage, action.mb)
    if action.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and action.stage < last:
        return ("grad", action.pipeline, action.stage, action.mb)
    return None


def source_worker(schedule: Schedule, message: tuple[str, int, int, int]) -> int:
    kind, pipeline, stage, _ = message
    return schedule.placement[pipeline][stage - 1 if kind == "act" else stage + 1]


def lower(schedule: Schedule, buffers: int = RECV_BUFFERS) -> Schedule:
    """The lowered schedule: per worker, compute and communication in posting order."""
    if schedule.lowered:
        return schedule
    times = {(e.worker, e.action): (e.start, e.end) for e in replay(schedule, ORDER_COSTS).events}
    messages = _messages(schedule, times)
    keys = _message_keys(messages, buffers)
    reduce_at = _reduction_times(schedule, times)
    workers = []
    for w, actions in enumerate(schedule.workers):
        posts = []
        for i, a in enumerate(actions):
            if a.op is Op.REDUCE_GRADS:
                lowered = Action(Op.ALLREDUCE, -1, a.pipeline, a.stage, group=stage_group(a.stage))
                posts.append(((reduce_at[a.stage], 1, a.stage, 0, 0, 0, 0, 0), lowered))
            else:
                posts.append(((times[(w, a)][0], 2, w, i, 0, 0, 0, 0), a))
        posts += [(m.order(keys[m]), m.action(Op.SEND)) for m in messages if m.src == w]
        posts += [(m.order(keys[m]), m.action(Op.RECV)) for m in messages if m.dst == w]
        workers.append(tuple(a for _, a in sorted(posts, key=lambda kv: kv[0])))
    return replace(schedule, workers=tuple(workers))


def _messages(schedule: Schedule, times: dict) -> list[Message]:
    consumer = {}
    for w, actions in enumerate(schedule.workers):
        for a in actions:
            needed = consumed_message(schedule, a)
            if needed is not None:
                consumer[needed] = (w, times[(w, a)][0])
    out = []
    for w, actions in enumerate(schedule.workers):
        for a in actions:
            message = produced_message(schedule, a)
            if message is None:
                continue
            dst, needed = consumer[message]
            if dst != w:
                out.append(Message(*message, src=w, dst=dst, ready=times[(w, a)][1], needed=needed))
    return out


def _message_keys(messages: list[Message], buffers: int) -> dict[Message, float]:
    """Posting time of each message: when it is ready, unless the receiver already has ``buffers``
    receives posted ahead; then when the earliest of them is consumed, but never after it is needed."""
    keys = {}
    for dst in {m.dst for m in messages}:
        outstanding: list[float] = []  # heap of the `needed` times of receives posted ahead
        for m in sorted((m for m in messages if m.dst == dst), key=lambda m: m.order(m.ready)):
            key = m.ready
            while outstanding and outstanding[0] <= key:
                heapq.heappop(outstanding)
            if len(outstanding) >= buffers:
                key = min(m.needed, max(key, heapq.heappop(outstanding)))
            keys[m] = key
            if key < m.needed:
                heapq.heappush(outstanding, m.needed)
    return keys


def _reduction_times(schedule: Schedule, times: dict) -> dict[int, float]:
    """Per model stage, when the last of its copies has finished its gradients: every member of the
    stage's group posts the all-reduce at that one key, so shared members agree on the order."""
    done: dict[int, float] = {}
    for w, actions in enumerate(schedule.workers):
        for a in actions:
            if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                done[a.stage] = max(done.get(a.stage, 0.0), times[(w, a)][1])
    return done


def forward_only(lowered: Schedule) -> Schedule:
    """What evaluation posts: the forwards and their activations, in the same relative order (a
    subsequence of a consistent order is consistent)."""
    keep = lambda a: a.op is Op.FORWARD or (a.op in (Op.SEND, Op.RECV) and a.kind == "act")  # noqa: E731
    return replace(lowered, workers=tuple(tuple(filter(keep, w)) for w in lowered.workers))


def compute_part(lowered: Schedule) -> Schedule:
    """The compute schedule inside a lowered one (ALLREDUCE back to R), for the compute validator."""
    workers = tuple(tuple(Action(Op.REDUCE_GRADS, -1, a.pipeline, a.stage) if a.op is Op.ALLREDUCE else a
                          for a in w if a.op not in (Op.SEND, Op.RECV)) for w in lowered.workers)
    return replace(lowered, workers=workers)
