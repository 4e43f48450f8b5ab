"""Each iteration's global batch, as Megatron-LM's training loop sizes it: megatron-core's micro-batch
calculator, updated at the start of every iteration with the samples consumed so far (its consistency check
on), gives the batch's size; the batch starts where the one before ended. Without a batch-size ramp every
batch is --global-batch-size. Every rank computes the same sizes from the same count, so all switch
schedules at the same iteration; a resumed run counts on from its checkpoint's consumed samples, as
Megatron-LM's does."""
from __future__ import annotations

from ..config.batch_ramp import step_calculator
from ..config.data_spec import DataSpec
from .datasets import GlobalBatch


class GlobalBatches:
    """The run's global batches from ``consumed`` samples on; ``consumed`` counts the samples of every batch
    handed out."""

    def __init__(self, data: DataSpec, consumed: int):
        steps = data.batch_steps or ((0, data.global_batch_size),)
        self.calculator = step_calculator(steps, micro_batch_size=data.micro_batch_size,
                                          data_parallel_size=data.data_parallel_size)
        self.consumed = consumed

    def next(self) -> GlobalBatch:
        self.calculator.update(self.consumed, consistency_check=True)
        batch = GlobalBatch(self.consumed, self.calculator.get_current_global_batch_size())
        self.consumed += batch.size
        return batch
