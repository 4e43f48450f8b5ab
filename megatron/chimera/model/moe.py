"""What megatron-core's schedules and Megatron-LM's training loop do for mixture-of-experts models
(and the auxiliary losses of multi-token prediction), which a schedule-as-data executor leaves to the
trainer.

A MoE layer's auxiliary losses (load balancing, z-loss) reach the gradients through
``MoEAuxLossAutoScaler``, whose backward multiplies them by one process-wide scale. megatron-core's
schedules set it in every forward step to 1 / N (the main loss's own averaging over the N
micro-batches; 1 with --calculate-per-token-loss). Our executor holds no megatron-core code, and the
value is one for every micro-batch of a flush, so the trainer sets it once before each flush, on every
rank: every stage that holds MoE layers scales its micro-batches' auxiliary losses alike, whichever
schedule runs them (split backward, DualPipe and evaluation included).

Aux-loss-free balancing (--moe-router-enable-expert-bias): each router counts the tokens it sends to
each expert; after the backward megatron-core's finalize_model_grads sums the counts over the global
batch and moves every expert's bias by the update rate toward the mean load. Here the global batch of
a stage is spread over its copies in both pipelines as well as the data-parallel replicas, so the
counts are summed over the stage's replica group (and the tensor-parallel group, whose ranks routed
different parts of the sequence), and every copy takes the same step.

The routers also add each layer's auxiliary losses into megatron-core's process-wide metrics tracker,
which Megatron-LM's training loop reports after every iteration (``track_moe_metrics``). The routers
number layers within their chunk, so on a rank holding two stage copies (Chimera) both add into the
same slots: the reported mean over the model's MoE layers sums every slot of every pipeline rank,
which counts each layer once per micro-batch all the same. Per-layer logging stays refused.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config.model_spec import ModelSpec
from .chunk import moe_layer_pattern


def scale_auxiliary_losses(config, num_microbatches: int, device: torch.device) -> None:
    """Before a flush: the scale megatron-core's forward step would give each micro-batch's auxiliary
    losses, the MoE layers' and multi-token prediction's (``MTPLossAutoScaler``, set the same way). The MoE
    layers' is CP times as large: their losses come from statistics over the whole sequence (the router's
    tensor-and-context-parallel group), whose gradients are then averaged over DP x CP."""
    one = torch.ones(1, device=device)
    scale = one if config.calculate_per_token_loss else one / num_microbatches
    if config.num_moe_experts is not None:
        cp = 1 if config.calculate_per_token_loss else config.context_parallel_size
        MoEAuxLossAutoScaler.set_loss_scale(scale * cp)
    if config.mtp_num_layers:
        MTPLossAutoScaler.set_loss_scale(scale)


@torch.no_grad()
def update_expert_bias(chunks: dict, rt, rate: float) -> None:
    """After a training flush (collective, stage by stage in one global order): each stage's routers'
    token counts summed over every copy of the stage, then each copy's expert bias stepped alike."""
    by_stage = {}
    for (_, stage), chunk in sorted(chunks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        routers = [m for m in chunk.modules() if getattr(m, "expert_bias", None) is not None]
        if routers:
            by_stage.setdefault(stage, []).append(routers)
    counts = {}
    for stage, copies in sorted(by_stage.items()):
        counts[stage] = torch.stack([torch.stack([r.local_tokens_per_expert for r in routers])
                                     for routers in copies]).sum(0)
        if rt.stage_groups.get(stage) is not None:
            rt.all_reduce(counts[stage], group=rt.stage_groups[stage])
    if counts and rt.tp > 1:
        flat = torch.cat(list(counts.values()))  # stages may hold different numbers of MoE layers
        rt.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
        counts = dict(zip(counts, flat.split([len(c) for c in counts.values()])))
    for stage, copies in by_stage.items():
        tokens = counts[stage]
        step = torch.sign(tokens.mean(dim=-1, keepdim=True) - tokens) * rate
        for routers in copies:
            for router, delta in zip(routers, step):
                router.expert_bias += delta
                router.local_tokens_per_expert.zero_()


def fresh_metrics(spec: ModelSpec, slots: int) -> None:
    """A new trainer starts empty trackers: the MoE one's entries all have ``slots`` slots (the most layers,
    MTP included, that one chunk numbers): the routers would size an entry by the first chunk that
    records, and under an uneven layout the pipeline ranks' entries must still match to be summed."""
    destroy_moe_metrics_tracker()
    MTPLossLoggingHelper.tracker.clear()  # sized by the first MTP loss: a new trainer may have other depths
    for name in _tracked(spec.config):
        get_moe_metrics_tracker().ensure_initialized(name, slots)


def _tracked(config: TransformerConfig) -> list[str]:
    """The MoE log fields Megatron-LM tracks for this configuration."""
    if config.num_moe_experts is None:
        return []
    balancing = config.moe_router_load_balancing_type  # one type or a list of them
    balancing = [balancing] if isinstance(balancing, str) else balancing
    return [name for name, on in (("load_balancing_loss", "aux_loss" in balancing),
                                  ("seq_load_balancing_loss", "seq_aux_loss" in balancing),
                                  ("global_load_balancing_loss", "global_aux_loss" in balancing),
                                  ("z_loss", config.moe_z_loss_coeff is not None)) if on]


def auxiliary_loss_fields(spec: ModelSpec, slots: int, num_microbatches: int, iteration: int) -> dict[str, float]:
    """After a training flush (collective): Megatron-LM's MoE log fields, ``load_balancing_loss``,
    ``seq_load_balancing_loss``, ``global_load_balancing_loss`` and ``z_loss`` as its configuration tracks
    them, each the mean over the MoE layers of the per-micro-batch mean, summed over the pipeline ranks and
    reduced over the data-parallel ones as megatron-core's tracker reduces each, which then clears."""
    config = spec.config
    names = _tracked(config)
    if not names:
        return {}
    totals = {}
    get_moe_metrics_tracker().report(loss_scale=1 / num_microbatches, iteration=iteration, force_initialize=True,
                                     track_names=names, num_layers=slots, moe_layer_freq=moe_layer_pattern(config),
                                     mtp_num_layers=config.mtp_num_layers, total_loss_dict=totals)
    return {name: float(value) for name, value in totals.items()}


def mtp_loss_fields(spec: ModelSpec, rt, num_microbatches: int) -> dict[str, float]:
    """After a training flush (collective): Megatron-LM's ``mtp_<k> loss`` log fields. megatron-core's
    MTP loss adds each micro-batch's per-token loss of depth k into its process-wide tracker on the
    ranks running the loss stage (both ends under Chimera, each with its micro-batches); the sum over
    all ranks, over TP (each tensor-parallel rank adds the same value) and DP (replicas average), is the
    global batch's, averaged over its micro-batches as Megatron-LM's training log does."""
    depth = spec.config.mtp_num_layers
    if not depth:
        return {}
    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values")
    total = torch.zeros(depth, dtype=torch.float64, device=rt.device)
    if values is not None:
        total += values.to(rt.device, torch.float64)
    rt.all_reduce(total)
    total /= rt.tp * rt.replicas * num_microbatches
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return {f"mtp_{k + 1} loss": float(v) for k, v in enumerate(total)}
