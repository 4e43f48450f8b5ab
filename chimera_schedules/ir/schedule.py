"""A schedule: what each pipeline worker runs in one iteration, in order.

A schedule is a value. Generators produce it; the validator, the simulator, the renderers and the
executor only read it. Unlike torch.distributed.pipelining's IR, an action names its pipeline as well
as its stage, so one model stage can live on several workers (Chimera's down and up pipelines).

Vocabulary:
- worker: a pipeline rank, 0..D-1 (D = ``depth``).
- pipeline: one copy of the whole model split into ``depth * virtual_stages`` model stages. 1F1B has
  one, Chimera two (down and up) or 2f.
- model stage: a contiguous slice of layers. With ``virtual_stages`` v > 1 (interleaved) a worker
  holds v of them per pipeline, each 1/v of a 1F1B stage.
- chunk: the model module that holds one stage copy on a worker (Megatron's "model chunk").
- placement[pipeline][stage] = the worker that holds that copy of that stage.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from .actions import COMM_OPS, COMPUTE_OPS, P2P_OPS, Action, Op, Overlapped, parts


def copies_held(placement: tuple[tuple[int, ...], ...], worker: int) -> list[tuple[int, int]]:
    """The (pipeline, stage) copies ``worker`` holds under ``placement``, in placement order (a schedule's,
    or the trainer's run plan's, which has one for megatron-core's schedules too)."""
    return [(p, s) for p, row in enumerate(placement) for s, w in enumerate(row) if w == worker]


@dataclass(frozen=True)
class Schedule:
    """Per worker, the ordered actions of one training iteration (one flush).

    ``depth`` is the number of workers D, ``virtual_stages`` the model stages each worker holds per
    pipeline (v: interleaved's chunks, 2 for DualPipeV), so a pipeline has ``stages_per_pipeline`` =
    D x v model stages, which an action's ``stage`` indexes. ``microbatch_scale`` is the size of an IR
    micro-batch relative to the user's micro-batch: 0.5 for backward halving, which runs twice as many
    half-size micro-batches. Costs and activation memory scale with it. The JSON form keeps the keys
    ``stages`` (= depth) and ``chunks`` (= virtual stages).
    """

    name: str
    depth: int
    microbatches: int
    placement: tuple[tuple[int, ...], ...]
    workers: tuple[tuple[Action | Overlapped, ...], ...]
    virtual_stages: int = 1
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
        return self.depth * self.virtual_stages

    def held(self, worker: int) -> list[tuple[int, int]]:
        """The (pipeline, stage) copies this worker holds, in placement order."""
        return copies_held(self.placement, worker)

    def compute(self, worker: int) -> list[Action | Overlapped]:
        """The worker's actions without the gradient reductions and communication (overlapped ones kept
        whole)."""
        return [a for a in self.workers[worker] if a.op in COMPUTE_OPS]

    @property
    def lowered(self) -> bool:
        """Whether the lists hold their communication (passes/lowering.py)."""
        return any(a.op in COMM_OPS for w in self.workers for a in w)

    @property
    def split_backward(self) -> bool:
        """Whether backwards run as I and W passes (read from the actions, so every reader agrees)."""
        return any(p.op is Op.BACKWARD_INPUT for w in self.workers for a in w for p in parts(a))

    def tokens(self, worker: int) -> str:
        return " ".join(str(a) for a in self.workers[worker])

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "stages": self.depth,
            "microbatches": self.microbatches,
            "pipelines": self.pipelines,
            "chunks": self.virtual_stages,
            "microbatch_scale": self.microbatch_scale,
            "placement": [list(row) for row in self.placement],
            "workers": [[a.to_json() for a in actions] for actions in self.workers],
            **({"meta": self.meta} if self.meta else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, obj: dict) -> Schedule:
        """Read the JSON form. Only ``stages``, ``microbatches`` and ``workers`` are required: a missing
        placement is inferred from where the actions run (the validator then checks it is a function)."""
        try:
            workers = tuple(tuple(Action.from_json(a) for a in w) for w in obj["workers"])
            depth, microbatches = int(obj["stages"]), int(obj["microbatches"])
        except KeyError as e:
            raise ValueError(f"not a schedule JSON object: missing {e}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a schedule JSON object: {e}") from None
        chunks = int(obj.get("chunks", 1))
        placement = obj.get("placement")
        if placement is None:
            placement = infer_placement(workers, depth * chunks)
        return cls(
            name=str(obj.get("name", "custom")),
            depth=depth,
            microbatches=microbatches,
            placement=tuple(tuple(int(w) for w in row) for row in placement),
            workers=workers,
            virtual_stages=chunks,
            microbatch_scale=float(obj.get("microbatch_scale", 1.0)),
            meta=dict(obj.get("meta", {})),
        )

    @classmethod
    def loads(cls, text: str) -> Schedule:
        return cls.from_json(json.loads(text))


def infer_placement(workers: Iterable[Iterable[Action | Overlapped]], stages_per_pipeline: int) -> list[list[int]]:
    """Placement read off the actions; -1 where no action names a (pipeline, stage)."""
    seen: dict[tuple[int, int], int] = {}
    for w, actions in enumerate(workers):
        for a in (p for action in actions for p in parts(action)):
            if a.op not in P2P_OPS:  # a message names the receiving stage, held by the peer
                seen.setdefault((a.pipeline, a.stage), w)
    pipelines = 1 + max((p for p, _ in seen), default=0)
    return [[seen.get((p, s), -1) for s in range(stages_per_pipeline)] for p in range(pipelines)]
