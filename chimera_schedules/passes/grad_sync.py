"""The gradient-reduction pass: an R for every stage copy, placed as early as its gradients allow."""
from __future__ import annotations

from ..ir.actions import Op, R, parts
from ..ir.schedule import Schedule


def with_grad_sync(schedule: Schedule) -> Schedule:
    """Add a gradient reduction for every stage copy a worker holds, right after that copy's last
    backward (or weight-grad) pass, which may sit inside an overlapped action: eager sync, overlapping
    the worker's remaining work. Copies that already have one keep theirs."""
    workers = []
    for w, actions in enumerate(schedule.workers):
        has_r = {(a.pipeline, a.stage) for a in actions if a.op is Op.REDUCE_GRADS}
        last = {}
        for i, a in enumerate(actions):
            for part in parts(a):
                if part.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                    last[(part.pipeline, part.stage)] = i
        out = []
        for i, a in enumerate(actions):
            out.append(a)
            out.extend(R(p, s) for (p, s), j in last.items() if j == i and (p, s) not in has_r)
        workers.append(tuple(out))
    return Schedule(
        name=schedule.name, depth=schedule.depth, microbatches=schedule.microbatches,
        placement=schedule.placement, workers=tuple(workers), virtual_stages=schedule.virtual_stages,
        microbatch_scale=schedule.microbatch_scale, meta=schedule.meta,
    )
