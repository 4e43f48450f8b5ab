"""The controllable-memory V schedules (Qi et al., "Pipeline Parallelism with Controllable Memory",
NeurIPS'24): V-Min, V-Half and V-ZB on the same IR.

All three fold one pipeline of 2D model stages into a V over D workers, as DualPipeV does: worker i holds
stage i (the down leg) and stage 2D-1-i (the up leg), so worker 0 holds the first stage and the loss. Every
backward is split into I and W, and a W frees its micro-batch's activations.

- **V-Min and V-Half** repeat one building block every 6 passes (a micro-batch's F, F, I, I, W, W on the
  worker's two chunks). The block fixes when each pass of micro-batch 0 starts; micro-batch k starts 6k
  slots later. Its lifespans set the peak: about 1/3 (V-Min) and 1/2 (V-Half) of 1F1B's activations, the
  memory bound the order keeps. As the authors' implementation does, W passes take the block's free slots;
  warm-up and cool-down passes then move to the earliest free slot that keeps their worker within the
  busiest worker's peak; the W passes are taken out, the cool-down moved again, and the W passes put back,
  the up leg's first (``_block_orders``). The executor runs the order as early as its messages allow (the
  paper's "squeeze").
- **V-ZB** has 1F1B's activation memory (D micro-batches' on a worker): its order is a
  greedy list schedule at the run's costs under that cap (``listsched.py``; a worker keeps a slot for the leg
  with nothing alive yet, so one leg's forwards never lock the other out), as the authors' V-ZB is a greedy
  simulation under the same cap; its W passes are then placed into the waits (``passes/zero_bubble.py``).
"""
from __future__ import annotations

import dataclasses

from ..ir.actions import Action, Op
from ..ir.costs import CostModel
from ..ir.errors import require
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync
from ..passes.zero_bubble import split_backward
from .listsched import Greed, Shape, list_schedule
from .placement import v_placement

MEMORY = ("min", "half", "zb")
PERIOD = 6  # passes per micro-batch on a worker: F and I and W on each of its two chunks


def check(depth: int, microbatches: int) -> None:
    require(depth >= 2, "depth", depth, "a V schedule needs at least 2 stages")
    require(microbatches >= 1, "microbatches", microbatches, "must be at least 1")


def block(depth: int, worker: int, memory: str) -> dict[str, int]:
    """The building block's start slot of micro-batch 0's passes on ``worker``: F0 (down-leg forward),
    F1 (up-leg forward), B0 (up-leg I, the first backward) and B1 (down-leg I). Each chain moves one slot
    per worker (V-Half's down-leg chains two), and ``shift`` moves the backwards so that the four
    passes fall on distinct slots of the period."""
    d, i = depth, worker
    if memory == "min":
        shift = 2 if d % 3 == 0 else 0
        return {"F0": i, "F1": 2 * d - 1 - i, "B0": 2 * d + shift + i, "B1": 4 * d + shift - 1 - i}
    shift = 3 if d % 2 == 0 else 0
    return {"F0": 2 * i, "F1": 3 * d - 2 - i, "B0": 3 * d - 1 + shift + 2 * i, "B1": 6 * d - 2 + shift - i}


Slots = dict[int, Action]  # one worker's passes by the unit time slot each starts in


def _pattern(depth: int, microbatches: int, worker: int, memory: str) -> Slots:
    """The building block repeated: each micro-batch's F and I passes on the worker, 6 slots apart."""
    down, up = worker, 2 * depth - 1 - worker
    passes = {"F0": (Op.FORWARD, down), "F1": (Op.FORWARD, up), "B0": (Op.BACKWARD_INPUT, up),
              "B1": (Op.BACKWARD_INPUT, down)}
    base = block(depth, worker, memory)
    slots = {base[name] + PERIOD * k: Action(op, k, 0, stage)
             for name, (op, stage) in passes.items() for k in range(microbatches)}
    require(len(slots) == 4 * microbatches, "depth", depth, "the building block's passes collide")
    return slots


def _put_w(slots: Slots, up_first: int | None) -> Slots:
    """The worker's passes without W, with each W in the first free slot after its I: the oldest I's
    first, or (``up_first``, the up leg's stage) that leg's first; the rest after the last pass."""
    passes = {t: a for t, a in slots.items() if a.op is not Op.BACKWARD_WEIGHT}
    out, waiting = {}, []
    for t in range(max(passes) + 1):
        if t in passes:
            out[t] = passes[t]
            if passes[t].op is Op.BACKWARD_INPUT:
                waiting.append(passes[t])
        elif waiting:
            pick = next((a for a in waiting if a.stage == up_first), waiting[0])
            waiting.remove(pick)
            out[t] = Action(Op.BACKWARD_WEIGHT, pick.mb, 0, pick.stage)
    for i, a in enumerate(waiting):
        out[max(passes) + 1 + i] = Action(Op.BACKWARD_WEIGHT, a.mb, 0, a.stage)
    return out


def _peak(slots: Slots) -> int:
    """The worker's most live micro-batch chunks: a forward adds one, a W frees one; without W passes,
    each free slot frees one whose I has run (where a W would go)."""
    explicit = any(a.op is Op.BACKWARD_WEIGHT for a in slots.values())
    live = peak = freeable = 0
    for t in range(max(slots) + 1):
        a = slots.get(t)
        if a is None:
            if not explicit and freeable:
                live, freeable = live - 1, freeable - 1
        elif a.op is Op.FORWARD:
            live += 1
        elif a.op is Op.BACKWARD_WEIGHT:
            live -= 1
        else:
            freeable += 1
        peak = max(peak, live)
    return peak


def _after(a: Action, last: int) -> list[Action]:
    """The passes ``a`` starts after: its input's producer and its own stage's previous micro-batch."""
    before = [dataclasses.replace(a, mb=a.mb - 1)] if a.mb else []
    if a.op is Op.FORWARD:
        return before + ([dataclasses.replace(a, stage=a.stage - 1)] if a.stage else [])
    if a.op is Op.BACKWARD_WEIGHT:
        return before + [dataclasses.replace(a, op=Op.BACKWARD_INPUT)]
    producer = dataclasses.replace(a, op=Op.FORWARD) if a.stage == last else dataclasses.replace(a, stage=a.stage + 1)
    return before + [producer]


def _reorder(workers: list[Slots], microbatches: int, warm_up_too: bool) -> list[Slots]:
    """Each pass of the warm-up (``warm_up_too``) and of the cool-down moved to the earliest free slot
    after what it waits for that keeps its worker within the busiest worker's peak, in slot order; the
    steady state (from worker 0's first down-leg I to its last down-leg forward) stays."""
    depth, cap = len(workers), max(map(_peak, workers))
    last = 2 * depth - 1
    where = {a: (w, t) for w, slots in enumerate(workers) for t, a in slots.items()}
    phase = 0
    for t, w, a in sorted((t, w, a) for w, slots in enumerate(workers) for t, a in slots.items()):
        if w == 0 and a == Action(Op.BACKWARD_INPUT, 0, 0, 0):
            phase = 1
        if phase == 2 or (phase == 0 and warm_up_too):
            slots = workers[w]
            earliest = 1 + max((where[b][1] for b in _after(a, last) if b in where), default=-1)
            for u in range(earliest, t):
                if u not in slots and _peak({**{k: v for k, v in slots.items() if k != t}, u: a}) <= cap:
                    del slots[t]
                    slots[u], where[a] = a, (w, u)
                    break
        if w == 0 and a == Action(Op.FORWARD, microbatches - 1, 0, 0):
            phase = 2
    return workers


def _block_orders(depth: int, microbatches: int, memory: str) -> list[list[Action]]:
    """The authors' steps: the block with W passes put in, warm-up and cool-down moved earlier; then
    the W passes taken out, the cool-down moved again, and the W passes put back, the up leg's first."""
    workers = [_put_w(_pattern(depth, microbatches, w, memory), None) for w in range(depth)]
    workers = _reorder(workers, microbatches, warm_up_too=True)
    workers = [{t: a for t, a in s.items() if a.op is not Op.BACKWARD_WEIGHT} for s in workers]
    workers = _reorder(workers, microbatches, warm_up_too=False)
    workers = [_put_w(s, 2 * depth - 1 - w) for w, s in enumerate(workers)]
    return [[s[t] for t in sorted(s)] for s in workers]


def v_block(depth: int, microbatches: int, memory: str) -> Schedule:
    """V-Min (``memory`` "min") or V-Half ("half")."""
    check(depth, microbatches)
    orders = tuple(map(tuple, _block_orders(depth, microbatches, memory)))
    return with_grad_sync(Schedule(f"v-{memory}", depth, microbatches, v_placement(depth), orders,
                                   virtual_stages=2))


def v_zb(depth: int, microbatches: int, costs: CostModel) -> Schedule:
    """V-ZB: the greedy order under 1F1B's activation memory, D micro-batches (2D chunks') per worker."""
    check(depth, microbatches)
    shape = Shape(depth, microbatches, v_placement(depth), (0,) * microbatches, virtual_stages=2)
    orders = list_schedule(shape, costs, cap=float(depth), greed=Greed(split=True, stage_limit=False, reserve=True))
    require(orders is not None, "microbatches", microbatches, "no V-ZB order fits 1F1B's memory")
    forwards_and_inputs = tuple(tuple(a for a in order if a.op is not Op.BACKWARD_WEIGHT) for order in orders)
    schedule = Schedule("v-zb", depth, microbatches, shape.placement, forwards_and_inputs, virtual_stages=2)
    return dataclasses.replace(split_backward(schedule, costs, [float(depth)] * depth), name="v-zb")


def v_schedule(depth: int, microbatches: int, memory: str, costs: CostModel) -> Schedule:
    return v_zb(depth, microbatches, costs) if memory == "zb" else v_block(depth, microbatches, memory)
