"""Actions: one step of one pipeline worker, with a string form (``F3p1s2``) and a JSON form.

Unlike torch.distributed.pipelining's ``_Action``, an action names its pipeline as well as its model
stage, so one model stage can live on several workers (Chimera's down and up pipelines).

An ``Overlapped`` action (``F3p0s1&B1p1s6``) runs a forward and the backward (or I) of another
micro-batch as one step, DualPipe style, so one micro-batch's expert all-to-all hides behind the other's
compute. It has no micro-batch, pipeline or stage of its own: a reader takes its ``parts``.

A ``Halved`` action (``F3p0s1/2``) runs one F, B or I as two halves of its micro-batch (the batch's
first and second half of its sequences) interleaved with each other, so one half's all-to-all hides
behind the other half's compute when no other micro-batch is there to pair with. It consumes and
produces what its whole action does; a reader takes its ``parts`` too (the whole action).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class Op(StrEnum):
    """Kinds of action. I and W split a backward into input- and weight-gradient parts (zero-bubble
    style); a schedule uses either B or the pair I, W for a given pass. R is the gradient all-reduce
    of one stage copy over its replica group: posted without blocking, completed before the step."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    REDUCE_GRADS = "R"
    OVERLAPPED = "FB"  # an F and a B or I of another micro-batch, run together (``Overlapped``)
    HALVED = "H"  # an F, B or I run as two interleaved halves of its micro-batch (``Halved``)
    # Communication, added by lowering (passes/lowering.py): each names its process group ("channel").
    SEND = "SEND"
    RECV = "RECV"
    ALLREDUCE = "ALLREDUCE"


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.OVERLAPPED, Op.HALVED)
COMPOUND_OPS = (Op.OVERLAPPED, Op.HALVED)  # actions without a micro-batch of their own: read their parts
HALVABLE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT)  # the passes that run all-to-alls
P2P_OPS = (Op.SEND, Op.RECV)
COMM_OPS = (Op.SEND, Op.RECV, Op.ALLREDUCE)
KINDS = ("act", "grad")  # activations flow to stage + 1, input gradients to stage - 1

_TOKEN = re.compile(r"^([FBIWR])(\d*)p(\d+)s(\d+)$")
# sA3p0s1>1@down: send the activation of micro-batch 3 for pipeline 0 stage 1 to worker 1 on group
# down; rG3p0s0<1@up receives a gradient from worker 1; ARp0s1@stage1 all-reduces a stage copy;
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
    def parse(cls, token: str) -> Action | Overlapped | Halved:
        """Inverse of ``str``: ``F3p1s2`` is the forward of micro-batch 3, pipeline 1, stage 2;
        ``F3p0s1&B1p1s6`` an overlapped forward and backward; ``F3p1s2/2`` the forward in two halves."""
        token = token.strip()
        if token.endswith("/2"):
            return Halved(cls.parse(token[:-2]))
        if "&" in token:
            pair = token.split("&")
            if len(pair) != 2 or any("@" in t for t in pair):
                raise ValueError(f"not an overlapped token: {token!r} (expected two compute tokens: F3p0s1&B1p1s6)")
            return Overlapped(*map(cls.parse, pair))
        if "@" in token:
            return cls._parse_comm(token)
        m = _TOKEN.match(token)
        if not m:
            raise ValueError(f"not an action token: {token!r} (expected e.g. F3p1s2, Rp0s1 or sA3p0s1>1@down)")
        op, mb, pipeline, stage = m.groups()
        if (op == "R") != (mb == ""):
            raise ValueError(f"not an action token: {token!r} (R has no micro-batch, F/B/I/W need one)")
        return cls(Op(op), int(mb) if mb else -1, int(pipeline), int(stage))

    @classmethod
    def _parse_comm(cls, token: str) -> Action:
        m = _COMM_TOKEN.match(token)
        if not m:
            raise ValueError(f"not a communication token: {token!r} (expected e.g. sA3p0s1>1@down or ARp0s1@stage1)")
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
    def from_json(cls, obj: dict) -> Action | Overlapped | Halved:
        op = Op(obj["op"])
        if op is Op.OVERLAPPED:
            return Overlapped.from_json(obj)
        if op is Op.HALVED:
            return Halved.from_json(obj)
        batch = int(obj.get("batch", -1))
        if op in P2P_OPS:
            if obj.get("kind") not in KINDS:
                raise ValueError(f"{op.value} needs \"kind\": one of {', '.join(KINDS)} (got {obj.get('kind')!r})")
            return cls(op, int(obj["mb"]), int(obj["pipeline"]), int(obj["stage"]), int(obj["peer"]),
                       str(obj["group"]), obj["kind"], batch)
        if op is Op.ALLREDUCE:
            return cls(op, -1, int(obj["pipeline"]), int(obj["stage"]), group=str(obj["group"]), batch=batch)
        return cls(op, int(obj.get("mb", -1)), int(obj["pipeline"]), int(obj["stage"]))


@dataclass(frozen=True, order=True)
class Overlapped:
    """The forward of one micro-batch and the backward (B or I) of another, run by one worker as one
    action: megatron-core's combined 1F1B interleaves their layers (``ir/parts.py``) so each one's
    all-to-alls run while the other computes. Deliberately without ``mb``, ``pipeline`` or ``stage``:
    every reader goes through ``parts()``, so one that is not ported fails loudly. The validator checks
    what makes it runnable (one F, one B or I, two micro-batches, neither needing the other)."""

    forward: Action
    backward: Action

    @property
    def op(self) -> Op:
        return Op.OVERLAPPED

    @property
    def parts(self) -> tuple[Action, Action]:
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"{self.forward}&{self.backward}"

    def to_json(self) -> dict:
        return {"op": Op.OVERLAPPED.value, "forward": self.forward.to_json(), "backward": self.backward.to_json()}

    @classmethod
    def from_json(cls, obj: dict) -> Overlapped:
        pair = [Action.from_json(obj[key]) for key in ("forward", "backward")]
        if any(isinstance(a, Overlapped) for a in pair):
            raise ValueError("an overlapped action holds plain actions, not overlapped ones")
        return cls(*pair)


@dataclass(frozen=True, order=True)
class Halved:
    """One F, B or I run as two halves of its micro-batch, interleaved on two streams
    (``ir/parts.py``'s ``halves``): each half's all-to-alls run while the other half computes. For an
    action with no partner in another micro-batch (warm-up, cool-down, N = D). Like ``Overlapped`` it
    has no ``mb`` of its own, so a reader goes through ``parts()`` (the whole action: what it consumes,
    produces and keeps alive is the whole micro-batch's)."""

    action: Action

    def __post_init__(self):
        if not isinstance(self.action, Action) or self.action.op not in HALVABLE_OPS:
            raise ValueError(f"only an F, B or I runs in halves, not {self.action}")

    @property
    def op(self) -> Op:
        return Op.HALVED

    @property
    def parts(self) -> tuple[Action]:
        return (self.action,)

    def __str__(self) -> str:
        return f"{self.action}/2"

    def to_json(self) -> dict:
        return {"op": Op.HALVED.value, "action": self.action.to_json()}

    @classmethod
    def from_json(cls, obj: dict) -> Halved:
        action = Action.from_json(obj["action"])
        if not isinstance(action, Action):
            raise ValueError("a halved action holds a plain F, B or I")
        return cls(action)


class HalvesSplit(NamedTuple):
    """Where a run's ``Halved`` actions cut their micro-batch: along ``input_dim`` of the stage input and
    output ([sequence, batch, hidden]) and ``data_dim`` of its data (Megatron-LM's get_batch: [batch,
    sequence]). The schedule is the same either way; the runtime cuts (runtime/stage.py) and the costs
    price the split's efficiency (costs.halves_efficiency_at)."""

    input_dim: int
    data_dim: int


BATCH = HalvesSplit(input_dim=1, data_dim=0)  # two halves of the micro-batch's sequences
SEQUENCE = HalvesSplit(input_dim=0, data_dim=1)  # each sequence's first and second half of its tokens


def parts(action: Action | Overlapped | Halved) -> tuple[Action, ...]:
    """The plain actions an action runs: an Overlapped's forward and backward, a Halved's whole action,
    else the action itself."""
    return action.parts if isinstance(action, (Overlapped, Halved)) else (action,)


def F(mb: int, pipeline: int, stage: int) -> Action:
    return Action(Op.FORWARD, mb, pipeline, stage)


def B(mb: int, pipeline: int, stage: int) -> Action:
    return Action(Op.BACKWARD, mb, pipeline, stage)


def R(pipeline: int, stage: int) -> Action:
    return Action(Op.REDUCE_GRADS, -1, pipeline, stage)
