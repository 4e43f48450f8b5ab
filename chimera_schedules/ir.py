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


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

_TOKEN = re.compile(r"^([FBIWR])(\d*)p(\d+)s(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one worker. ``mb`` is -1 for R, which covers every micro-batch of the stage."""

    op: Op
    mb: int
    pipeline: int
    stage: int

    def __str__(self) -> str:
        mb = "" if self.op is Op.REDUCE_GRADS else str(self.mb)
        return f"{self.op.value}{mb}p{self.pipeline}s{self.stage}"

    @classmethod
    def parse(cls, token: str) -> "Action":
        """Inverse of ``str``: ``F3p1s2`` is the forward of micro-batch 3, pipeline 1, stage 2."""
        m = _TOKEN.match(token.strip())
        if not m:
            raise ValueError(f"not an action token: {token!r} (expected e.g. F3p1s2 or Rp0s1)")
        op, mb, pipeline, stage = m.groups()
        if (op == "R") != (mb == ""):
            raise ValueError(f"not an action token: {token!r} (R has no micro-batch, F/B/I/W need one)")
        return cls(Op(op), int(mb) if mb else -1, int(pipeline), int(stage))

    def to_json(self) -> dict:
        return {"op": self.op.value, "mb": self.mb, "pipeline": self.pipeline, "stage": self.stage}

    @classmethod
    def from_json(cls, obj: dict) -> "Action":
        return cls(Op(obj["op"]), int(obj.get("mb", -1)), int(obj["pipeline"]), int(obj["stage"]))


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
        """The worker's actions without the gradient reductions."""
        return [a for a in self.workers[worker] if a.op in COMPUTE_OPS]

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
        except (KeyError, TypeError, ValueError) as e:
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
