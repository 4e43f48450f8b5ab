"""The schedules Chimera is measured against: GPipe, 1F1B (DAPPLE / PipeDream-Flush) and Megatron's
interleaved 1F1B. One pipeline; worker w holds model stages w, w+D, w+2D, ... (v chunks)."""
from __future__ import annotations

from ..ir.actions import Action, B, F
from ..ir.errors import require
from ..ir.schedule import Schedule
from ..passes.grad_sync import with_grad_sync


def _single_pipeline(name: str, depth: int, microbatches: int, orders: list[list[Action]],
                     virtual_stages: int = 1) -> Schedule:
    placement = (tuple(s % depth for s in range(depth * virtual_stages)),)
    return with_grad_sync(Schedule(name, depth, microbatches, placement,
                                   tuple(tuple(o) for o in orders), virtual_stages=virtual_stages))


def _check_common(depth: int, microbatches: int) -> None:
    require(depth >= 1, "depth", depth, "must be at least 1")
    require(microbatches >= 1, "microbatches", microbatches, "must be at least 1")


def check_interleaved(depth: int, microbatches: int, virtual_stages: int) -> None:
    """Every rule an interleaved request must meet, each naming its option."""
    _check_common(depth, microbatches)
    require(virtual_stages >= 1, "virtual_stages", virtual_stages, "must be at least 1")
    require(microbatches % depth == 0, "microbatches", microbatches,
            f"interleaved 1F1B needs a multiple of $depth ({depth})")


def gpipe(depth: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards in the same (FIFO) order, as in the paper's Figure 1."""
    _check_common(depth, microbatches)
    orders = [[F(m, 0, w) for m in range(microbatches)] + [B(m, 0, w) for m in range(microbatches)]
              for w in range(depth)]
    return _single_pipeline("gpipe", depth, microbatches, orders)


def one_f_one_b(depth: int, microbatches: int) -> Schedule:
    """Worker w runs D-1-w warm-up forwards, then alternates one forward and one backward, then
    drains: at most D-w micro-batches alive."""
    _check_common(depth, microbatches)
    orders = []
    for w in range(depth):
        warmup = min(depth - 1 - w, microbatches)
        order = [F(m, 0, w) for m in range(warmup)]
        for i in range(microbatches - warmup):
            order += [F(warmup + i, 0, w), B(i, 0, w)]
        order += [B(m, 0, w) for m in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return _single_pipeline("1f1b", depth, microbatches, orders)


def interleaved(depth: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: the k-th forward of a worker runs chunk (k // D) % v on micro-batch
    (k // (D v)) D + k % D; backwards walk the chunks in reverse. Warm-up: 2 (D-1-w) + (v-1) D."""
    check_interleaved(depth, microbatches, virtual_stages)
    total = microbatches * virtual_stages

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // depth) % virtual_stages
        if backward:
            chunk = virtual_stages - 1 - chunk
        return chunk, (k // (depth * virtual_stages)) * depth + k % depth

    orders = []
    for w in range(depth):
        if virtual_stages == 1:
            warmup = min(depth - 1 - w, total)
        elif microbatches == depth:  # as Megatron: no steady state, everything is warm-up
            warmup = total
        else:
            warmup = min(2 * (depth - 1 - w) + (virtual_stages - 1) * depth, total)

        def fwd(k):
            c, m = unit(k, False)
            return F(m, 0, c * depth + w)

        def bwd(k):
            c, m = unit(k, True)
            return B(m, 0, c * depth + w)

        order = [fwd(k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [fwd(warmup + i), bwd(i)]
        order += [bwd(k) for k in range(total - warmup, total)]
        orders.append(order)
    return _single_pipeline("interleaved", depth, microbatches, orders, virtual_stages=virtual_stages)
