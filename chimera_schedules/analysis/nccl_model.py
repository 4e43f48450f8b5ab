"""NCCL's rules (shared/NCCL_MODEL.md) as a replay of lowered schedules: the communication checker,
and the simulator's pricing of communication.

``check(lowered, mode)`` raises with the reason when a lowered schedule would deadlock or deliver the
wrong message; ``run_lowered(lowered, mode, costs)`` replays it at the given costs. Each worker's host
walks its list in order; compute runs on one stream once its inputs' RECVs have completed;
communication is posted onto FIFO queues, one per (worker, group, peer) for p2p and one per (worker,
communicator) for collectives (``shared_groups``). Modes: ``nccl`` (every p2p a rendezvous),
``nccl-single-queue`` (also one queue per device: ``CUDA_DEVICE_MAX_CONNECTIONS=1``) and ``gloo``
(sends complete when posted). The rules in full, how messages are matched and why expert all-to-alls
cannot cross: docs/notes/nccl-model.md.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from ..ir.actions import COMM_OPS, Action, Op, Overlapped, parts
from ..ir.channels import EMBEDDING_GROUP, EMBEDDING_META, expert_group, reduces, stage_group
from ..ir.costs import CostModel, Event
from ..ir.dataflow import consumed_messages, produced_messages, source_worker
from ..ir.errors import InvalidSchedule
from ..ir.schedule import Schedule
from .validator import validate

MODES = ("gloo", "nccl", "nccl-single-queue")
_GRAD_DONE = (Op.BACKWARD, Op.BACKWARD_WEIGHT)  # the passes after which a copy's gradient is final


@dataclass(eq=False)
class _Item:
    """One posted operation, or one batch, of one worker."""

    worker: int
    ops: list[Action]
    op_queues: list[tuple]  # each op's queue
    queues: list[tuple]
    posted: float
    matched: dict[int, float] = field(default_factory=dict)  # op index -> end time
    end: float | None = None

    def pending(self, queue: tuple, op: Op) -> int | None:
        for i, a in enumerate(self.ops):
            if i not in self.matched and a.op is op and self.op_queues[i] == queue:
                return i
        return None


def shared_groups(s: Schedule) -> dict[str, str]:
    """Each collective group -> the communicator it runs on, named by all the groups sharing it
    ("stage0/stage3"): one per set of workers holding a stage (data and tensor parallelism multiply
    every stage's ranks alike), the embedding group's being its stages' holders. A stage's expert group
    (where the lists post one) spans the stage's workers but may have fewer ranks, so its own process
    group: it is modelled on the stage's communicator all the same, the stricter model (lists that
    complete with both on one queue complete with each on its own, which keeps their order)."""
    holders = lambda stage: frozenset(row[stage] for row in s.placement)  # noqa: E731
    posted = {a.group for actions in s.workers for a in actions if a.op is Op.ALLREDUCE}
    by_workers = {}
    for stage in range(s.stages_per_pipeline):
        named = [stage_group(stage)] + [expert_group(stage)] * (expert_group(stage) in posted)
        by_workers.setdefault(holders(stage), []).extend(named)
    tied = s.meta.get(EMBEDDING_META, ())
    if tied:
        by_workers.setdefault(frozenset().union(*map(holders, tied)), []).append(EMBEDDING_GROUP)
    return {name: "/".join(names) for names in by_workers.values() for name in names}


@dataclass
class LoweredRun:
    events: list[Event]
    transfers: list[Event]
    reductions: list[Event]
    finish: list[float]


def check(lowered: Schedule, mode: str) -> None:
    """Raise InvalidSchedule unless every worker's list completes under ``mode``'s rules."""
    run_lowered(lowered, mode, CostModel(1.0, 1.0))


def run_lowered(lowered: Schedule, mode: str, costs: CostModel) -> LoweredRun:
    """Replay under ``mode`` with ``costs``; raise InvalidSchedule on a malformed list or a deadlock."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    validate(lowered)
    check_structure(lowered)
    run = _NcclRun(lowered, mode, costs)
    run.run()
    return LoweredRun(run.events, run.transfers, run.reductions, run.finish())


def check_structure(s: Schedule) -> None:
    """Every remote input has a RECV from its producer before its consumer, every remote output a
    SEND after its producer, each exactly once, batches are consecutive p2p operations, and the expert
    and embedding reductions are where they belong (``_check_wider_reductions``)."""
    _check_wider_reductions(s)
    for w, actions in enumerate(s.workers):
        sent, received, computed, batches = set(), set(), set(), []
        for a in actions:
            if a.op not in COMM_OPS:
                _check_compute_inputs(s, w, a, received)
                computed.add(a)
                continue
            _check_comm(s, w, a, sent, received, computed)
            if a.batch >= 0 and (not batches or batches[-1] != a.batch):
                if a.batch in batches:
                    raise InvalidSchedule(f"batch {a.batch} is not consecutive", w, a)
                batches.append(a.batch)
        _check_outputs(s, w, actions, sent)


def _check_wider_reductions(s: Schedule) -> None:
    """Where any worker posts a stage's expert reduction (on ``experts{S}``) or the tied embedding's (on
    ``embedding``, over the stages the lowered meta names), every worker holding a copy of what it sums
    posts it once, and no other, after that worker's last backward of those copies: the checker counts
    a group's members from the lists, so a member left out would go unseen."""
    tied = tuple(s.meta.get(EMBEDDING_META, ()))
    posted = {a.group for actions in s.workers for a in actions if a.op is Op.ALLREDUCE}
    for w, actions in enumerate(s.workers):
        held = {stage for _, stage in s.held(w)}
        # group -> (the stage its reduction names, the held stages whose copies it sums)
        expected = {expert_group(stage): (stage, (stage,)) for stage in held if expert_group(stage) in posted}
        if EMBEDDING_GROUP in posted and held & set(tied):
            expected[EMBEDDING_GROUP] = (tied[0], tuple(stage for stage in tied if stage in held))
        pending = Counter(p.stage for a in actions if a.op not in COMM_OPS for p in parts(a) if p.op in _GRAD_DONE)
        for a in actions:
            for p in parts(a) if a.op not in COMM_OPS else ():
                pending[p.stage] -= p.op in _GRAD_DONE
            if a.op is not Op.ALLREDUCE or reduces(a.group) == "stage":
                continue
            named, sums = expected.pop(a.group, (None, ()))
            if a.stage != named:
                raise InvalidSchedule(f"posted twice, or where no copy of what group {a.group} sums is held, "
                                      f"or naming another stage than {named}", w, a)
            if any(pending[stage] for stage in sums):
                raise InvalidSchedule("reduction posted before the last backward of a copy it sums", w, a)
        if expected:
            raise InvalidSchedule(f"no reduction posted on {', '.join(sorted(expected))}, whose copies it holds", w)


def _check_comm(s: Schedule, w: int, a: Action, sent: set, received: set, computed: set) -> None:
    if not a.group:
        raise InvalidSchedule("communication names no group", w, a)
    if a.op is Op.ALLREDUCE:
        if a.batch >= 0:
            raise InvalidSchedule("a batch holds sends and receives only", w, a)
        return
    if not (0 <= a.peer < s.num_workers) or a.peer == w:
        raise InvalidSchedule(f"peer {a.peer} is not another worker", w, a)
    message = a.message
    if not (0 <= a.pipeline < s.pipelines and 0 <= a.stage < s.stages_per_pipeline and 0 <= a.mb < s.microbatches):
        raise InvalidSchedule("no such message in this schedule", w, a)
    src, dst = _ends(s, message)
    if src < 0:
        raise InvalidSchedule("no such message: nothing is sent to that stage", w, a)
    if (a.op is Op.SEND and (src, dst) != (w, a.peer)) or (a.op is Op.RECV and (src, dst) != (a.peer, w)):
        raise InvalidSchedule(f"this message goes from worker {src} to worker {dst}", w, a)
    book = sent if a.op is Op.SEND else received
    if message in book:
        raise InvalidSchedule("message posted twice", w, a)
    book.add(message)
    if a.op is Op.SEND and not any(message in produced_messages(s, c) for c in computed):
        raise InvalidSchedule("send posted before the compute that produces it", w, a)


def _ends(s: Schedule, message: tuple) -> tuple[int, int]:
    kind, pipeline, stage, _ = message
    if kind == "act" and stage == 0 or kind == "grad" and stage == s.stages_per_pipeline - 1:
        return -1, -1
    return source_worker(s, message), s.placement[pipeline][stage]


def _check_compute_inputs(s: Schedule, w: int, a: Action | Overlapped, received: set) -> None:
    for needed in consumed_messages(s, a):
        if source_worker(s, needed) != w and needed not in received:
            raise InvalidSchedule(f"no RECV of its input from worker {source_worker(s, needed)} is posted before it",
                                  w, a)


def _check_outputs(s: Schedule, w: int, actions, sent: set) -> None:
    for a in actions:
        for message in produced_messages(s, a) if a.op not in COMM_OPS else ():
            holder = s.placement[message[1]][message[2]]
            if holder != w and message not in sent:
                raise InvalidSchedule(f"its output is never sent to worker {holder}", w, a)


class _NcclRun:
    """The hosts, streams and queues of every worker, stepped until every list completes."""

    def __init__(self, s: Schedule, mode: str, costs: CostModel):
        self.s, self.mode, self.costs = s, mode, costs
        self.transfer = costs.transfer_time(s)
        self.pc = [0] * s.num_workers
        self.time = [0.0] * s.num_workers
        self.blocked: list[_Item | None] = [None] * s.num_workers  # single queue: the item the host waits on
        self.queues: dict[tuple, deque] = {}
        self.free: dict[tuple, float] = {}
        self.arrived: dict[tuple, float] = {}  # (worker, message) -> when its RECV completed
        self.posted_recv: dict[tuple, _Item] = {}
        self.sent: dict[tuple, deque] = {}  # gloo: (group, src, dst) -> sent messages and times
        self.communicator = shared_groups(s)
        self.members = {}
        for w, actions in enumerate(s.workers):
            for a in actions:
                if a.op is Op.ALLREDUCE:
                    self.members.setdefault(self._queue(a)[1], set()).add(w)
        self.events, self.transfers, self.reductions = [], [], []

    def run(self) -> None:
        progress = True
        while progress:
            progress = any([self._host(w) for w in range(self.s.num_workers)])
            progress = self._match_p2p() or progress
            progress = self._match_collectives() or progress
        if any(self.pc[w] < len(self.s.workers[w]) or self.blocked[w] for w in range(self.s.num_workers)) \
                or any(self.queues.values()):
            raise self._deadlock()

    def _queue(self, a: Action) -> tuple:
        if a.op is Op.ALLREDUCE:
            return "coll", self.communicator.get(a.group, a.group)
        return "p2p", a.group, a.peer

    def finish(self) -> list[float]:
        out = list(self.time)
        for (w, _), t in self.free.items():
            out[w] = max(out[w], t)
        return out

    # ------------------------------------------------------------------------------ hosts
    def _host(self, w: int) -> bool:
        actions, moved = self.s.workers[w], False
        while self.pc[w] < len(actions) and self.blocked[w] is None:
            a = actions[self.pc[w]]
            if a.op in COMM_OPS:
                ops, nxt = [a], self.pc[w] + 1
                while a.batch >= 0 and nxt < len(actions) and actions[nxt].op in COMM_OPS \
                        and actions[nxt].batch == a.batch:
                    ops.append(actions[nxt])
                    nxt += 1
                self._post(w, ops)
                self.pc[w] += len(ops)
            elif not self._compute(w, a):
                break
            else:
                self.pc[w] += 1
            moved = True
        return moved

    def _remote_inputs(self, w: int, a: Action | Overlapped) -> list[tuple]:
        """The messages a compute action waits for from other workers."""
        return [m for m in consumed_messages(self.s, a) if source_worker(self.s, m) != w]

    def _compute(self, w: int, a: Action | Overlapped) -> bool:
        remote = self._remote_inputs(w, a)
        if any((w, m) not in self.arrived for m in remote):
            return False
        ready = [max((self.arrived[(w, m)] for m in self._remote_inputs(w, p)), default=0.0) for p in parts(a)]
        start, ends = self.costs.run_times(self.s, a, self.time[w], ready)  # a pair's parts wait for their own
        end = max(ends)
        self.events.append(Event(w, a, start, end))
        self.time[w] = end
        return True

    def _post(self, w: int, ops: list[Action]) -> None:
        op_queues = [self._queue(a) for a in ops]
        item = _Item(w, ops, op_queues, list(dict.fromkeys(op_queues)), self.time[w])
        for q in item.queues:
            self.queues.setdefault((w, q), deque()).append(item)
        for i, a in enumerate(ops):
            if a.op is Op.RECV:
                self.posted_recv[(w, a.message)] = item
            elif a.op is Op.SEND and self.mode == "gloo":  # buffered: complete at once
                self.sent.setdefault((a.group, w, a.peer), deque()).append((a, self.time[w]))
                self._complete(item, i, self.time[w])
        collective_on_host = ops[0].op is Op.ALLREDUCE and self.costs.collectives_use_compute
        if (self.mode == "nccl-single-queue" or collective_on_host) and item.end is None:
            self.blocked[w] = item

    # ------------------------------------------------------------------------------ matching
    def _active(self, item: _Item) -> bool:
        return all(self.queues[(item.worker, q)][0] is item for q in item.queues)

    def _head(self, w: int, q: tuple) -> _Item | None:
        queue = self.queues.get((w, q))
        return queue[0] if queue else None

    def _match_p2p(self) -> bool:
        moved = False
        for (w, q), queue in list(self.queues.items()):
            if q[0] != "p2p" or not queue or not self._active(queue[0]):
                continue
            item = queue[0]
            i = item.pending(q, Op.RECV)
            if i is None:
                continue
            a = item.ops[i]
            if self.mode == "gloo":
                moved = self._match_gloo(item, i, a) or moved
                continue
            partner = self._head(a.peer, ("p2p", a.group, w))
            if partner is None or not self._active(partner):
                continue
            j = partner.pending(("p2p", a.group, w), Op.SEND)
            if j is None:
                continue
            self._same_message(partner.ops[j], a)
            start = max(item.posted, partner.posted, self.free.get((w, q), 0.0),
                        self.free.get((a.peer, ("p2p", a.group, w)), 0.0))
            self._complete(partner, j, start + self.transfer)
            self._complete(item, i, start + self.transfer)
            moved = True
        return moved

    def _match_gloo(self, item: _Item, i: int, a: Action) -> bool:
        sent = self.sent.get((a.group, a.peer, item.worker))
        if not sent:
            return False
        send, posted = sent.popleft()
        self._same_message(send, a)
        q = ("p2p", a.group, a.peer)
        self._complete(item, i, max(item.posted, posted, self.free.get((item.worker, q), 0.0)) + self.transfer)
        return True

    def _same_message(self, send: Action, recv: Action) -> None:
        if send.message != recv.message:
            raise InvalidSchedule(f"mismatched messages on group {recv.group}: worker {recv.peer} posts {send} "
                                  f"where worker {send.peer} expects {recv} (matched by order: wrong data)",
                                  send.peer, recv)

    def _complete(self, item: _Item, i: int, end: float) -> None:
        item.matched[i] = end
        a = item.ops[i]
        if a.op is Op.RECV:
            self.arrived[(item.worker, a.message)] = end
        if a.op in (Op.SEND, Op.RECV):
            self.transfers.append(Event(item.worker, a, end - self.transfer, end))
        if len(item.matched) < len(item.ops):
            return
        item.end = max(item.matched.values())
        for q in item.queues:
            queue = self.queues[(item.worker, q)]
            if queue and queue[0] is item:
                queue.popleft()
            else:
                queue.remove(item)  # gloo sends leave their queue at once
            self.free[(item.worker, q)] = max(self.free.get((item.worker, q), 0.0), item.end)
        if self.blocked[item.worker] is item:
            self.blocked[item.worker] = None
            self.time[item.worker] = max(self.time[item.worker], item.end)

    def _match_collectives(self) -> bool:
        moved = False
        for group, members in self.members.items():
            heads = [self._head(m, ("coll", group)) for m in sorted(members)]
            if any(h is None for h in heads):
                continue
            first = heads[0].ops[0]
            for h in heads[1:]:
                if (h.ops[0].group, h.ops[0].stage) != (first.group, first.stage):
                    raise InvalidSchedule(f"collectives out of order on group {group}: worker {heads[0].worker} "
                                          f"posts {first} where worker {h.worker} posts {h.ops[0]} (matched by "
                                          f"order: wrong data)", h.worker, h.ops[0])
            start = max([h.posted for h in heads] + [self.free.get((h.worker, ("coll", group)), 0.0) for h in heads])
            end = start + self.costs.allreduce_time(self.s, len(members))
            for h in heads:
                self.reductions.append(Event(h.worker, h.ops[0], start, end))
                self._complete(h, 0, end)
            moved = True
        return moved

    # ------------------------------------------------------------------------------ diagnosis
    def _deadlock(self) -> InvalidSchedule:
        """Follow 'waits for' from a stuck host until a step repeats: that is the cycle."""
        busy = {w for (w, _), queue in self.queues.items() if queue}
        stuck = next(w for w in range(self.s.num_workers)
                     if self.pc[w] < len(self.s.workers[w]) or self.blocked[w] or w in busy)
        node, chain = ("host", stuck, None), []
        while node not in [c[0] for c in chain]:
            text, nxt = self._waits(node)
            chain.append((node, text))
            if nxt is None:
                return InvalidSchedule(f"deadlock ({self.mode}): " + " -> ".join(t for _, t in chain), stuck)
            node = nxt
        start = [c[0] for c in chain].index(node)
        cycle = " -> ".join(t for _, t in chain[start:])
        w = chain[start][0][1]
        return InvalidSchedule(f"deadlock ({self.mode}): wait-for cycle: {cycle}", w)

    def _waits(self, node) -> tuple[str, tuple | None]:
        kind, w, item = node
        if kind == "host":
            return self._host_waits(w)
        for q in item.queues:  # not at the head of one of its queues: waits behind that head
            head = self._head(w, q)
            if head is not item:
                return (f"worker {w}'s {_ops(item)} waits behind {_ops(head)} on {_qname(q)}", ("item", w, head))
        a = next(a for i, a in enumerate(item.ops) if i not in item.matched)
        if a.op is Op.ALLREDUCE:
            q = self._queue(a)
            m = next(m for m in sorted(self.members[q[1]]) if self._head(m, q) is None)
            return f"worker {w}'s {a} on {_qname(q)} waits for worker {m} to post it", ("host", m, None)
        partner = self._head(a.peer, ("p2p", a.group, w))
        if partner is None or (self.mode == "gloo" and a.op is Op.RECV):
            return (f"worker {w}'s {a} on group {a.group} waits for worker {a.peer} to post its partner",
                    ("host", a.peer, None))
        return (f"worker {w}'s {a} on group {a.group} waits for worker {a.peer}, whose stream for this pair "
                f"is at {_ops(partner)}", ("item", a.peer, partner))

    def _host_waits(self, w: int) -> tuple[str, tuple | None]:
        if self.blocked[w] is not None:
            item = self.blocked[w]
            why = "single hardware queue" if self.mode == "nccl-single-queue" else "a collective on the host"
            return f"worker {w} blocks on {_ops(item)} ({why})", ("item", w, item)
        if self.pc[w] < len(self.s.workers[w]):
            a = self.s.workers[w][self.pc[w]]
            needed = next(m for m in self._remote_inputs(w, a) if (w, m) not in self.arrived)
            item = self.posted_recv[(w, needed)]
            q = self._queue(next(r for r in item.ops if r.op is Op.RECV and r.message == needed))
            head = self._head(w, q)
            return f"worker {w} at {a} waits for its input ({_ops(item)})", ("item", w, head)
        for (v, q), queue in self.queues.items():
            if v == w and queue:
                return f"worker {w} at the end of its list waits for {_ops(queue[0])}", ("item", w, queue[0])
        return f"worker {w} is done", None


def _ops(item: _Item | None) -> str:
    if item is None:
        return "nothing"
    return str(item.ops[0]) if len(item.ops) == 1 else "batch [" + " ".join(map(str, item.ops)) + "]"


def _qname(q: tuple) -> str:
    return f"group {q[1]}" + (f" (pair with worker {q[2]})" if q[0] == "p2p" else "")
