"""What megatron-core's schedules and Megatron-LM's training loop do for mixture-of-experts models,
which a schedule-as-data executor leaves to the trainer.

A MoE layer's auxiliary losses (load balancing, z-loss) reach the gradients through
``MoEAuxLossAutoScaler``, whose backward multiplies them by one process-wide scale. megatron-core's
schedules set it in every forward step to 1 / N (the main loss's own averaging over the N
micro-batches; 1 with --calculate-per-token-loss). Our executor holds no megatron-core code, and the
value is one for every micro-batch of a flush, so the trainer sets it once before each flush, on every
rank: every stage that holds MoE layers scales its micro-batches' auxiliary losses alike, whichever
schedule runs them (split backward, DualPipe and evaluation included).

The routers also add each layer's auxiliary losses into megatron-core's process-wide metrics tracker,
which Megatron-LM's training loop reports after every iteration (``track_moe_metrics``). The routers
number layers within their chunk, so on a rank holding two stage copies (Chimera) both add into the
same slots: the reported mean over the model's MoE layers sums every slot of every pipeline rank,
which counts each layer once per micro-batch all the same. Per-layer logging stays refused.
"""
from __future__ import annotations

import torch

from .chunk import moe_layer_pattern


def scale_auxiliary_losses(config, num_microbatches: int, device: torch.device) -> None:
    """Before a flush: the scale megatron-core's forward step would give each micro-batch's losses."""
    if config.num_moe_experts is None:
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    one = torch.ones(1, device=device)
    MoEAuxLossAutoScaler.set_loss_scale(one if config.calculate_per_token_loss else one / num_microbatches)


def fresh_metrics() -> None:
    """A new trainer starts an empty tracker (its entries are sized by the first chunk that records)."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()


def auxiliary_loss_fields(args, layers_per_stage: int, num_microbatches: int, iteration: int) -> dict[str, float]:
    """After a training flush (collective): Megatron-LM's MoE log fields, ``load_balancing_loss``,
    ``seq_load_balancing_loss`` and ``z_loss`` as its configuration tracks them, each the mean over
    the MoE layers of the per-micro-batch mean, summed over the pipeline ranks and averaged over the
    data-parallel ones by megatron-core's tracker, which then clears."""
    if args.num_experts is None:
        return {}
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    balancing = args.moe_router_load_balancing_type  # one type or a list of them
    balancing = [balancing] if isinstance(balancing, str) else balancing
    names = [name for name, on in (("load_balancing_loss", "aux_loss" in balancing),
                                   ("seq_load_balancing_loss", "seq_aux_loss" in balancing),
                                   ("z_loss", args.moe_z_loss_coeff is not None)) if on]
    if not names:
        return {}
    totals = {}
    get_moe_metrics_tracker().report(loss_scale=1 / num_microbatches, iteration=iteration, force_initialize=True,
                                     track_names=names, num_layers=layers_per_stage,
                                     moe_layer_freq=moe_layer_pattern(args), total_loss_dict=totals)
    return {name: float(value) for name, value in totals.items()}
