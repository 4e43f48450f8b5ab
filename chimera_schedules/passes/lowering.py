"""Lowering: a compute schedule becomes the list each worker posts, communication included.

Every cross-worker message becomes a SEND on its producer's worker and a RECV on its consumer's,
and every gradient reduction an ALLREDUCE, each naming its process group (``ir/channels.py``). An
overlapped action is one compute action: the messages both its parts consume are received before it,
those both produce are sent after it.

Posting order. The compute schedule is replayed once under fixed unit costs (``ORDER_COSTS``), which
gives every action and message a time. Each worker then posts its operations sorted by one global key:
a message at the time it is posted (both ends use the same key), a compute action at its start, an
all-reduce when the last copy of its stage is ready, ties broken the same way on every worker. So
both ends of every channel see its messages in the same order, and every group's members see its
collectives in the same order. Because the keys come from a run that finishes, the lists finish even
when every operation blocks until its partner arrives (``nccl-single-queue``); ``nccl_model.py``
checks that rather than trusting this argument.

Reductions over wider groups. Asked to (the trainer does under --overlap-grad-reduce), lowering also
posts, on every worker holding the stage, each stage's routed-expert reduction on ``experts{S}`` just
after the stage's own (same time, so all of the stage's copies are done), and, on every worker holding a
copy of a tied word embedding, one reduction of it on ``embedding`` when the last of its copies (first
and last stage, MTP's) has its gradients; ``meta["embedding_stages"]`` records which stages those are, for
the checker. Their keys are global too, so every group's members post them in one order.

Receives are posted ahead of need: a message's key is the time its producer finishes, so the
transfer overlaps whatever the receiver computes meanwhile. At most ``buffers`` receives are posted
ahead on a worker; a message beyond that is posted when a buffer frees (or just before it is needed),
its send moving with it so both ends keep the same key.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from ..analysis.replay import replay
from ..ir.actions import Action, Op, parts
from ..ir.channels import EMBEDDING_GROUP, EMBEDDING_META, expert_group, p2p_group, stage_group
from ..ir.costs import CostModel
from ..ir.dataflow import consumed_messages, produced_messages
from ..ir.schedule import Schedule

ORDER_COSTS = CostModel(forward=1.0, backward=2.0)  # for the posting order only, never for timing
RECV_BUFFERS = 3
_KIND_RANK = {"act": 0, "grad": 1}


@dataclass(frozen=True)
class _Message:
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
        return Action(op, self.mb, self.pipeline, self.stage, peer, p2p_group(self.src, self.dst), self.kind)

    def order(self, time: float) -> tuple:
        return (time, 0, self.src, self.dst, _KIND_RANK[self.kind], self.pipeline, self.stage, self.mb)


def lower(schedule: Schedule, buffers: int = RECV_BUFFERS, experts: bool = False,
          embedding_stages: tuple[int, ...] = ()) -> Schedule:
    """The lowered schedule: per worker, compute and communication in posting order. ``experts``: post
    each stage's expert reduction too; ``embedding_stages``: the stages holding copies of a tied word
    embedding, whose reduction is posted too when there are two or more (``_wider_reductions``)."""
    if schedule.lowered:
        return schedule
    times = {(e.worker, e.action): (e.start, e.end) for e in replay(schedule, ORDER_COSTS, whole_pairs=True).events}
    messages = _messages(schedule, times)
    keys = _message_keys(messages, buffers)
    reduce_at = _reduction_times(schedule, times)
    tied = tuple(sorted(embedding_stages)) if len(embedding_stages) > 1 else ()
    workers = []
    for w, actions in enumerate(schedule.workers):
        posts = []
        for i, a in enumerate(actions):
            if a.op is Op.REDUCE_GRADS:
                lowered = Action(Op.ALLREDUCE, -1, a.pipeline, a.stage, group=stage_group(a.stage))
                posts.append(((reduce_at[a.stage], 1, a.stage, 0, 0, 0, 0, 0), lowered))
            else:
                posts.append(((times[(w, a)][0], 2, w, i, 0, 0, 0, 0), a))
        posts += _wider_reductions(schedule, w, reduce_at, experts, tied)
        posts += [(m.order(keys[m]), m.action(Op.SEND)) for m in messages if m.src == w]
        posts += [(m.order(keys[m]), m.action(Op.RECV)) for m in messages if m.dst == w]
        workers.append(tuple(a for _, a in sorted(posts, key=lambda kv: kv[0])))
    meta = {**schedule.meta, EMBEDDING_META: list(tied)} if tied else schedule.meta
    return replace(schedule, workers=tuple(workers), meta=meta)


def _messages(schedule: Schedule, times: dict) -> list[_Message]:
    consumer = {}
    for w, actions in enumerate(schedule.workers):
        for a in actions:
            for needed in consumed_messages(schedule, a):
                consumer[needed] = (w, times[(w, a)][0])
    out = []
    for w, actions in enumerate(schedule.workers):
        for a in actions:
            for message in produced_messages(schedule, a):
                dst, needed = consumer[message]
                if dst != w:
                    out.append(_Message(*message, src=w, dst=dst, ready=times[(w, a)][1], needed=needed))
    return out


def _message_keys(messages: list[_Message], buffers: int) -> dict[_Message, float]:
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


def _wider_reductions(schedule: Schedule, w: int, reduce_at: dict[int, float], experts: bool,
                      tied: tuple[int, ...]) -> list[tuple[tuple, Action]]:
    """(key, ALLREDUCE) of the reductions over groups wider than a stage copy that worker ``w`` posts:
    each held stage's experts, keyed just after the stage's own reduction; the tied embedding, once,
    keyed at the end of the last of its copies' gradients, after every stage's reduction at that time.
    An expert reduction names the worker's (last) copy of the stage; the embedding's names stage
    ``tied[0]`` on every member (the checker matches a collective by its group and stage)."""
    held = {stage: pipeline for pipeline, stage in schedule.held(w) if stage in reduce_at}
    posts = []
    if experts:
        posts += [((reduce_at[s], 1, s, 1, 0, 0, 0, 0), Action(Op.ALLREDUCE, -1, p, s, group=expert_group(s)))
                  for s, p in sorted(held.items())]
    if tied and set(held) & set(tied):
        at = max(reduce_at[s] for s in tied)
        posts.append(((at, 1, schedule.stages_per_pipeline, 0, 0, 0, 0, 0),
                      Action(Op.ALLREDUCE, -1, 0, tied[0], group=EMBEDDING_GROUP)))
    return posts


def _reduction_times(schedule: Schedule, times: dict) -> dict[int, float]:
    """Per model stage, when the last of its copies has finished its gradients: every member of the
    stage's group posts the all-reduce at that one key, so shared members agree on the order. A backward
    inside an overlapped action is done when the action ends."""
    done: dict[int, float] = {}
    for w, actions in enumerate(schedule.workers):
        for a in actions:
            for part in parts(a):
                if part.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                    done[part.stage] = max(done.get(part.stage, 0.0), times[(w, a)][1])
    return done
