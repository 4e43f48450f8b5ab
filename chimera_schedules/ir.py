"""The schedule IR: what each pipeline worker runs, in order.

A schedule is a value. Generators produce it; the validator, the simulator, the renderers and the
executor only read it. Unlike torch.distributed.pipelining's IR, an action names its pipeline as well
as its stage, so one model stage can live on several workers (Chimera's down and up pipelines).

Vocabulary:
- worker: a pipeline rank, 0..D-1 (D = ``stages``).
- pipeline: one copy of the whole model split into ``stages * chunks`` model stages. 1F1B has one,
  Chimera two (down and up) or 2f.
- model stage: a contiguous slice of layers. With ``chunks`` v > 1 (interleaved) a worker holds v of
  them per pipeline, each 1/v of a 1F1B stage.
- placement[pipeline][stage] = the worker that holds that copy of that stage.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable


class Op(str, Enum):
    """Kinds of action. I and W split a backward into input- and weight-gradient parts (zero-bubble
    style); a schedule uses either B or the pair I, W for a given pass. R is the gradient all-reduce
    of one stage copy over its replica group: posted without blocking, completed before the step."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    REDUCE_GRADS = "R"
    # Communication, added by lowering (lowering.py): each names its process group ("channel").
    SEND = "SEND"
    RECV = "RECV"
    ALLREDUCE = "ALLREDUCE"


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
P2P_OPS = (Op.SEND, Op.RECV)
COMM_OPS = (Op.SEND, Op.RECV, Op.ALLREDUCE)
KINDS = ("act", "grad")  # activations flow to stage + 1, input gradients to stage - 1

_TOKEN = re.compile(r"^([FBIWR])(\d*)p(\d+)s(\d+)$")
# sA3p0s1>1@p0.act: send the activation of micro-batch 3 for pipeline 0 stage 1 to worker 1 on group
# p0.act; rG3p0s0<1@p0.grad receives a gradient from worker 1; ARp0s1@stage1 all-reduces a stage copy;
# "#5" appended puts an operation in batch 5 (posted together with its batch in one batch_isend_irecv).
_COMM_TOKEN = re.compile(r"^(?:([sr])([AG])(\d+)p(\d+)s(\d+)([<>])(\d+)|AR()p(\d+)s(\d+))@([^#\s]+)(?:#(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one worker. ``mb`` is -1 for R and ALLREDUCE, which cover every micro-batch of the
    stage copy. SEND and RECV carry one message: ``kind`` ("act" or "grad") of micro-batch ``mb`` for
    ``pipeline``, received by ``stage``; ``peer`` is the other worker, ``group`` the process group it
    travels on, ``batch`` (-1: none) groups a worker's consecutive operations into one batch."""

    op: Op
    mb: int
    pipeline: int
    stage: int
    peer: int = -1
    group: str = ""
    kind: str = ""
    batch: int = -1

    @property
    def message(self) -> tuple[str, int, int, int]:
        """What a SEND or RECV carries: (kind, pipeline, receiving stage, micro-batch)."""
        return (self.kind, self.pipeline, self.stage, self.mb)

    def __str__(self) -> str:
        if self.op in P2P_OPS:
            text = (f"{'s' if self.op is Op.SEND else 'r'}{self.kind[0].upper()}{self.mb}p{self.pipeline}"
                    f"s{self.stage}{'>' if self.op is Op.SEND else '<'}{self.peer}@{self.group}")
        elif self.op is Op.ALLREDUCE:
            text = f"ARp{self.pipeline}s{self.stage}@{self.group}"
        else:
            mb = "" if self.op is Op.REDUCE_GRADS else str(self.mb)
            return f"{self.op.value}{mb}p{self.pipeline}s{self.stage}"
        return text + (f"#{self.batch}" if self.batch >= 0 else "")

    @classmethod
    def parse(cls, token: str) -> "Action":
        """Inverse of ``str``: ``F3p1s2`` is the forward of micro-batch 3, pipeline 1, stage 2."""
        token = token.strip()
        if "@" in token:
            return cls._parse_comm(token)
        m = _TOKEN.match(token)
        if not m:
            raise ValueError(f"not an action token: {token!r} (expected e.g. F3p1s2, Rp0s1 or sA3p0s1>1@p0.act)")
        op, mb, pipeline, stage = m.groups()
        if (op == "R") != (mb == ""):
            raise ValueError(f"not an action token: {token!r} (R has no micro-batch, F/B/I/W need one)")
        return cls(Op(op), int(mb) if mb else -1, int(pipeline), int(stage))

    @classmethod
    def _parse_comm(cls, token: str) -> "Action":
        m = _COMM_TOKEN.match(token)
        if not m:
            raise ValueError(f"not a communication token: {token!r} (expected e.g. sA3p0s1>1@p0.act or ARp0s1@stage1)")
        sr, kind, mb, p, s, arrow, peer, _, ar_p, ar_s, group, batch = m.groups()
        batch = int(batch) if batch else -1
        if sr is None:
            return cls(Op.ALLREDUCE, -1, int(ar_p), int(ar_s), group=group, batch=batch)
        if (sr == "s") != (arrow == ">"):
            raise ValueError(f"not a communication token: {token!r} (a send points > to its peer, a receive <)")
        op = Op.SEND if sr == "s" else Op.RECV
        return cls(op, int(mb), int(p), int(s), int(peer), group, {"A": "act", "G": "grad"}[kind], batch)

    def to_json(self) -> dict:
        obj = {"op": self.op.value, "mb": self.mb, "pipeline": self.pipeline, "stage": self.stage}
        if self.op in P2P_OPS:
            obj.update(peer=self.peer, group=self.group, kind=self.kind)
        elif self.op is Op.ALLREDUCE:
            obj.update(group=self.group)
            del obj["mb"]
        if self.batch >= 0:
            obj["batch"] = self.batch
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "Action":
        op = Op(obj["op"])
        batch = int(obj.get("batch", -1))
        if op in P2P_OPS:
            if obj.get("kind") not in KINDS:
                raise ValueError(f"{op.value} needs \"kind\": one of {', '.join(KINDS)} (got {obj.get('kind')!r})")
            return cls(op, int(obj["mb"]), int(obj["pipeline"]), int(obj["stage"]), int(obj["peer"]),
                       str(obj["group"]), obj["kind"], batch)
        if op is Op.ALLREDUCE:
            return cls(op, -1, int(obj["pipeline"]), int(obj["stage"]), group=str(obj["group"]), batch=batch)
        return cls(op, int(obj.get("mb", -1)), int(obj["pipeline"]), int(obj["stage"]))


def F(mb: int, pipeline: int, stage: int) -> Action:
    return Action(Op.FORWARD, mb, pipeline, stage)


def B(mb: int, pipeline: int, stage: int) -> Action:
    return Action(Op.BACKWARD, mb, pipeline, stage)


def R(pipeline: int, stage: int) -> Action:
    return Action(Op.REDUCE_GRADS, -1, pipeline, stage)


@dataclass(frozen=True)
class Schedule:
    """Per worker, the ordered actions of one training iteration (one flush).

    ``microbatch_scale`` is the size of an IR micro-batch relative to the user's micro-batch: 0.5 for
    backward halving, which runs twice as many half-size micro-batches. Costs and activation memory
    scale with it.
    """

    name: str
    stages: int
    microbatches: int
    placement: tuple[tuple[int, ...], ...]
    workers: tuple[tuple[Action, ...], ...]
    chunks: int = 1
    microbatch_scale: float = 1.0
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def pipelines(self) -> int:
        return len(self.placement)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def stages_per_pipeline(self) -> int:
        return self.stages * self.chunks

    def held(self, worker: int) -> list[tuple[int, int]]:
        """The (pipeline, stage) copies this worker holds, in placement order."""
        return [(p, s) for p, row in enumerate(self.placement) for s, w in enumerate(row) if w == worker]

    def compute(self, worker: int) -> list[Action]:
        """The worker's actions without the gradient reductions and communication."""
        return [a for a in self.workers[worker] if a.op in COMPUTE_OPS]

    @property
    def lowered(self) -> bool:
        """Whether the lists hold their communication (see lowering.py)."""
        return any(a.op in COMM_OPS for w in self.workers for a in w)

    def tokens(self, worker: int) -> str:
        return " ".join(str(a) for a in self.workers[worker])

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "pipelines": self.pipelines,
            "chunks": self.chunks,
            "microbatch_scale": self.microbatch_scale,
            "placement": [list(row) for row in self.placement],
            "workers": [[a.to_json() for a in actions] for actions in self.workers],
            **({"meta": self.meta} if self.meta else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, obj: dict) -> "Schedule":
        """Read the JSON form. Only ``stages``, ``microbatches`` and ``workers`` are required: a missing
        placement is inferred from where the actions run (the validator then checks it is a function)."""
        try:
            workers = tuple(tuple(Action.from_json(a) for a in w) for w in obj["workers"])
            stages, microbatches = int(obj["stages"]), int(obj["microbatches"])
        except KeyError as e:
            raise ValueError(f"not a schedule JSON object: missing {e}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a schedule JSON object: {e}") from None
        chunks = int(obj.get("chunks", 1))
        placement = obj.get("placement")
        if placement is None:
            placement = infer_placement(workers, stages * chunks)
        return cls(
            name=str(obj.get("name", "custom")),
            stages=stages,
            microbatches=microbatches,
            placement=tuple(tuple(int(w) for w in row) for row in placement),
            workers=workers,
            chunks=chunks,
            microbatch_scale=float(obj.get("microbatch_scale", 1.0)),
            meta=dict(obj.get("meta", {})),
        )

    @classmethod
    def loads(cls, text: str) -> "Schedule":
        return cls.from_json(json.loads(text))


def infer_placement(workers: Iterable[Iterable[Action]], stages_per_pipeline: int) -> list[list[int]]:
    """Placement read off the actions; -1 where no action names a (pipeline, stage)."""
    seen: dict[tuple[int, int], int] = {}
    for w, actions in enumerate(workers):
        for a in actions:
            if a.op not in P2P_OPS:  # a message names the receiving stage, held by the peer
                seen.setdefault((a.pipeline, a.stage), w)
    pipelines = 1 + max((p for p, _ in seen), default=0)
    return [[seen.get((p, s), -1) for s in range(stages_per_pipeline)] for p in range(pipelines)]


def with_grad_sync(schedule: Schedule) -> Schedule:
    """Add a gradient reduction for every stage copy a worker holds, right after that copy's last
    backward (or weight-grad) pass: eager sync, overlapping the worker's remaining work. Copies that
    already have one keep theirs."""
    workers = []
    for w, actions in enumerate(schedule.workers):
        has_r = {(a.pipeline, a.stage) for a in actions if a.op is Op.REDUCE_GRADS}
        last = {}
        for i, a in enumerate(actions):
            if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                last[(a.pipeline, a.stage)] = i
        out = []
        for i, a in enumerate(actions):
            out.append(a)
            out.extend(R(p, s) for (p, s), j in last.items() if j == i and (p, s) not in has_r)
        workers.append(tuple(out))
    return Schedule(
        name=schedule.name, stages=schedule.stages, microbatches=schedule.microbatches,
        placement=schedule.placement, workers=tuple(workers), chunks=schedule.chunks,
        microbatch_scale=schedule.microbatch_scale, meta=schedule.meta,
    )
