"""BitPipe (Wu, Chen and Yu, "BitPipe: Bidirectional Interleaved Pipeline Parallelism for Accelerating
Large Models Training", 2024; the authors' Megatron-LM fork, ``--enable-bitpipe-schedule``) on the same IR.

Two V-shaped pipelines run in opposite directions over the same D workers, so that, as in Chimera, each
worker holds two copies' worth of weights: four chunks of half a 1F1B stage. The down pipeline (0) runs
its first D model stages over workers 0..D-1 and its last D back over D-1..0; the up pipeline (1) is its
mirror, first D stages over D-1..0, last D over 0..D-1. Workers w and D-1-w hold the same layers, and
their copies' gradients are summed as Chimera's are.

In every D consecutive micro-batches the first D/2 go down and the rest up. A worker's forwards and
backwards follow the fork's order, unit by unit (D micro-batches a unit): a warm-up of 3D/2 + min(w,
D-1-w) chunk forwards, then one forward and one backward at a time, and units joined by direct
concatenation (a burst of backwards, then of forwards, between them). docs/schedules.md ("Chimera beside its
successors") has the source and the order's terms.
"""
from __future__ import annotations

from ..ir.actions import Action, Op
from ..ir.errors import require
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync
from .placement import v_placement


def check(depth: int, microbatches: int) -> None:
    require(depth >= 2 and depth % 2 == 0, "depth", depth, "BitPipe needs an even number of stages (at least 2)")
    require(microbatches % depth == 0, "microbatches", microbatches,
            f"BitPipe needs a multiple of $depth ({depth}): each unit of D micro-batches sends half each way")


def placement(depth: int) -> tuple[tuple[int, ...], ...]:
    """The down pipeline's V and its mirror."""
    down = v_placement(depth)[0]
    return down, tuple(depth - 1 - w for w in down)


def _chunk_lists(depth: int, microbatches: int, worker: int) -> dict[str, list[Action]]:
    """A worker's forwards, by chunk: its own direction's first and second half ("own1", "own2") and
    the other direction's ("oth1", "oth2"), each in micro-batch order. Its own direction is the one
    whose first half starts nearer: down on the first half of the workers."""
    half, rows = depth // 2, placement(depth)
    down = [m for m in range(microbatches) if m % depth < half]
    up = [m for m in range(microbatches) if m % depth >= half]

    def chunk(pipeline: int, mbs: list[int], second: bool) -> list[Action]:
        stage = [s for s, w in enumerate(rows[pipeline]) if w == worker][int(second)]
        return [Action(Op.FORWARD, m, pipeline, stage) for m in mbs]

    own, other = ((0, down), (1, up)) if worker < half else ((1, up), (0, down))
    return {"own1": chunk(*own, False), "own2": chunk(*own, True),
            "oth1": chunk(*other, False), "oth2": chunk(*other, True)}


def _unit(lists: dict[str, list[Action]], unit: int, half: int, m: int, first: str, second: str) -> list[Action]:
    """One unit's passes in the fork's pattern, over ``first`` then ``second`` half chunks ("1" then "2"
    for forwards, "2" then "1" for backwards): the own direction's first ``m`` passes, then the two
    directions alternating, then the own direction's rest."""
    own1, own2, oth1, oth2 = (lists[k][unit * half:(unit + 1) * half]
                              for k in (f"own{first}", f"own{second}", f"oth{first}", f"oth{second}"))
    out = own1[:m]
    for i in range(half - m):
        out += [oth1[i], own1[i + m]]
    for i in range(m):
        out += [oth1[i + half - m], oth2[i]]
    for i in range(half - m):
        out += [own2[i], oth2[i + m]]
    return out + own2[half - m:]


def _worker_order(depth: int, microbatches: int, worker: int) -> list[Action]:
    half, lists = depth // 2, _chunk_lists(depth, microbatches, worker)
    m = half - worker if worker < half else worker - half + 1
    units = microbatches // depth
    forwards = [a for u in range(units) for a in _unit(lists, u, half, m, "1", "2")]
    backwards = [Action(Op.BACKWARD, a.mb, a.pipeline, a.stage)
                 for u in range(units) for a in _unit(lists, u, half, m, "2", "1")]
    warm = 3 * depth // 2 + min(worker, depth - 1 - worker)
    steady = 2 * depth - warm
    order, f, b = forwards[:warm], warm, 0

    def pairs(count: int) -> None:
        nonlocal f, b
        for _ in range(count):
            order.extend([forwards[f], backwards[b]])
            f, b = f + 1, b + 1

    for _ in range(units - 1):
        pairs(steady)
        order.extend(backwards[b:b + warm - steady + 1])
        b += warm - steady + 1
        pairs(steady - 1)
        order.extend(forwards[f:f + warm - steady + 1])
        f += warm - steady + 1
    pairs(steady)
    return order + backwards[b:]


def bitpipe(depth: int, microbatches: int) -> Schedule:
    check(depth, microbatches)
    orders = tuple(tuple(_worker_order(depth, microbatches, w)) for w in range(depth))
    return with_grad_sync(Schedule("bitpipe", depth, microbatches, placement(depth), orders, virtual_stages=2))
