"""What megatron-core's schedules do for mixture-of-experts models that a schedule-as-data executor
leaves to the trainer.

A MoE layer's auxiliary losses (load balancing, z-loss) reach the gradients through
``MoEAuxLossAutoScaler``, whose backward multiplies them by one process-wide scale. megatron-core's
schedules set it in every forward step to 1 / N (the main loss's own averaging over the N
micro-batches; 1 with --calculate-per-token-loss). Our executor holds no megatron-core code, and the
value is one for every micro-batch of a flush, so the trainer sets it once before each flush, on every
rank: every stage that holds MoE layers scales its micro-batches' auxiliary losses alike, whichever
schedule runs them (split backward, DualPipe and evaluation included).

The routers also add each layer's auxiliary losses into megatron-core's process-wide metrics tracker,
which Megatron-LM's logging reports and clears every iteration. This trainer does not report them
yet, so each flush starts a fresh tracker (sized by the chunk that records first), rather than
letting one grow across iterations and across trainers built in one process.
"""
from __future__ import annotations

import torch


def prepare_flush(config, num_microbatches: int, device: torch.device) -> None:
    """Before a flush of a MoE model: the auxiliary losses' scale, and a fresh metrics tracker."""
    if config.num_moe_experts is None:
        return
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    destroy_moe_metrics_tracker()
    one = torch.ones(1, device=device)
    MoEAuxLossAutoScaler.set_loss_scale(one if config.calculate_per_token_loss else one / num_microbatches)
