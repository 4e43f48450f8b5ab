"""The run's plan, built once after parsing and always present: where the stage copies are, how many
micro-batches an iteration has and how big, in which order each held chunk runs its forwards, and
the function that runs an iteration's forwards and backwards.

Our schedules (``SchedulePlan``) run through the schedule executor, which posts the gradient
reductions itself. megatron-core's own schedules and no pipelining (``MegatronCorePlan``) run
``get_forward_backward_func`` behind the same interface, reducing the gradients afterwards, so the
trainer, the data and the process groups never ask which kind they have.
"""
from __future__ import annotations

from chimera_schedules import Op, Schedule


class SchedulePlan:
    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.placement = schedule.placement
        self.microbatches, self.microbatch_scale = schedule.microbatches, schedule.microbatch_scale

    def forward_orders(self, worker: int, held) -> list[list[int]]:
        """Per held chunk, its micro-batches in the order the schedule runs their forwards."""
        actions = self.schedule.workers[worker]
        return [[a.mb for a in actions if a.op is Op.FORWARD and (a.pipeline, a.stage) == key] for key in held]

    def runner(self, models, make_transport, grad_sync, tracer):
        """(forward_backward, the transport it owns)."""
        from chimera_schedules.runtime.executor import make_forward_backward
        from chimera_schedules.passes.lowering import lower

        transport = make_transport()
        return make_forward_backward(lower(self.schedule), transport, grad_sync, tracer), transport


class MegatronCorePlan:
    """megatron-core's 1F1B or interleaved schedule (or no pipelining), stage s on worker s mod PP."""

    def __init__(self, args):
        pp = args.pipeline_model_parallel_size
        self.placement = (tuple(s % pp for s in range(args.model_stages)),)
        self.microbatches, self.microbatch_scale = args.num_microbatches, 1.0
        self.virtual_stages = args.model_stages // pp if args.pipeline_schedule == "megatron-interleaved" else None

    def forward_orders(self, worker: int, held) -> list[list[int]]:
        return [list(range(self.microbatches)) for _ in held]

    def runner(self, models, make_transport, grad_sync, tracer):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if self.virtual_stages:  # how megatron-core's interleaved schedule tells the last virtual stage
            for m in models:
                m.config.virtual_pipeline_model_parallel_size = self.virtual_stages
        schedule = get_forward_backward_func()

        def forward_backward(**kwargs):
            reports = schedule(**kwargs)
            if not kwargs["forward_only"]:
                grad_sync.reduce_all()  # megatron-core's schedules post no reductions themselves
            return reports

        return forward_backward, None


def run_plan(args):
    return SchedulePlan(args.schedule) if args.schedule is not None else MegatronCorePlan(args)
