"""The communication of the executor before lowering existed, written out as a lowered schedule:
one process group per pipeline carrying activations down and gradients up, each send posted right
after its producer, each receive just before its consumer, each reduction where the compute schedule
has it. Tests show the NCCL checker and the emulated NCCL transport both reject it."""
from __future__ import annotations

from dataclasses import replace

from chimera_schedules.ir.actions import Action, Op
from chimera_schedules.ir.dataflow import consumed_messages, produced_messages, source_worker
from chimera_schedules.ir.schedule import Schedule


def legacy_lower(schedule: Schedule) -> Schedule:
    workers = []
    for w, actions in enumerate(schedule.workers):
        out = []
        for a in actions:
            if a.op is Op.REDUCE_GRADS:
                out.append(Action(Op.ALLREDUCE, -1, a.pipeline, a.stage, group=f"stage{a.stage}"))
                continue
            for needed in consumed_messages(schedule, a):
                if source_worker(schedule, needed) != w:
                    out.append(_p2p(Op.RECV, needed, source_worker(schedule, needed)))
            out.append(a)
            for made in produced_messages(schedule, a):
                if schedule.placement[made[1]][made[2]] != w:
                    out.append(_p2p(Op.SEND, made, schedule.placement[made[1]][made[2]]))
        workers.append(tuple(out))
    return replace(schedule, name=schedule.name + " (one group per pipeline)", workers=tuple(workers))


def _p2p(op: Op, message: tuple, peer: int) -> Action:
    kind, pipeline, stage, mb = message
    return Action(op, mb, pipeline, stage, peer, f"p{pipeline}", kind)
