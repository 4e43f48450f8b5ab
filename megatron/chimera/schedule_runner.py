"""The iteration's forward_backward function for a run plan, with megatron-core's keyword signature.

Our schedules run through the schedule executor (chimera_schedules/runtime/executor.py), which posts the
gradient reductions itself. megatron-core's own schedules and no pipelining run ``get_forward_backward_func``
behind the same call, with the GradSync's hooks in their config as Megatron-LM's train() sets them, and its
``finish`` afterwards (finalize_model_grads' place), so nothing downstream asks which kind it has.
"""
from __future__ import annotations

from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from chimera_schedules.ir.actions import BATCH, SEQUENCE
from chimera_schedules.runtime.executor import make_forward_backward

from .config.run_plan import RunPlan
from .model.sequence_halves import SequenceHalves


def runner(plan: RunPlan, models, transport, grad_sync, observer=None, nvtx_ranges: bool = False):
    """``transport`` (ours only) carries the messages; ``observer`` (the executor's Observer protocol: the
    trainer's hooks) sees our actions; ``nvtx_ranges`` (--nvtx-ranges) gives each of our actions an NVTX
    range on a GPU."""
    if plan.lowered is not None:
        if plan.halves is SEQUENCE:  # halves of a sequence: the second's attention reads the first's keys
            for model in models:
                SequenceHalves.install(unwrap_model(model))
        return make_forward_backward(plan.lowered, transport, grad_sync, observer, nvtx_ranges,
                                     schedule_plans=plan.overlap, halves=plan.halves or BATCH)
    return _megatron_core_runner(models, grad_sync, plan.megatron_virtual_stages)


def _megatron_core_runner(models, grad_sync, virtual_stages: int | None):
    if virtual_stages:  # how megatron-core's interleaved schedule tells the last virtual stage
        for m in models:
            m.config.virtual_pipeline_model_parallel_size = virtual_stages
    _overlap_grad_reduce(models, grad_sync)
    schedule = get_forward_backward_func()

    def forward_backward(**kwargs):
        reports = schedule(**kwargs)
        if not kwargs["forward_only"]:
            grad_sync.finish()  # what has not started yet (everything without --overlap-grad-reduce)
        return reports

    return forward_backward


def _overlap_grad_reduce(models, grad_sync) -> None:
    """Megatron-LM's train() with --overlap-grad-reduce (and its default --align-grad-reduce): each
    chunk's ``no_sync`` in config.no_sync_func, its ``start_grad_sync`` in config.grad_sync_func, a list
    for several chunks (gradients.ChunkGradSync). config.param_sync_func stays unset: with
    --overlap-param-gather our weight gathers start right after the step, and each chunk's forward
    pre-hook waits for its own (distributed_optimizer.py)."""
    chunks = grad_sync.chunk_syncs(models)
    if chunks is None:
        return
    config = models[0].config  # get_model_config(model[0]): the one the schedules read
    assert config.no_sync_func is None, "a model chunk's config already has a no_sync_func"
    config.no_sync_func = [c.no_sync for c in chunks]
    config.grad_sync_func = [c.start_grad_sync for c in chunks]
    if len(chunks) == 1:
        config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
