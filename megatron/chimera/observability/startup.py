"""Megatron-LM's startup output, so a user's log parsers find it (its validate_args prints the arguments
banner): "building GPT model ...", the parameter count of every model chunk (for Chimera, one line per stage
copy), and the bytes of model state each rank holds; and ours: the line saying the schedule's communication
was proven, and the pipeline layout the stages were cut by."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..config.data_spec import DataSpec
from ..config.model_spec import ModelSpec
from ..config.run_plan import PROOF_MODE
from ..model.chunk import fusions_off, shared_expert_overlap, te_only_recompute
from ..optim.optimizer import ModelStateBytes


def print_building(spec: ModelSpec, transformer_engine: bool, device_type: str) -> None:
    """Megatron-LM's line, and once what a flag does here if not what it does on a GPU. ``spec``: the
    model, for model/chunk.py's rules; ``device_type``: the device init_distributed trains on."""
    if dist.get_rank() != 0:
        return
    print("building GPT model ...", flush=True)
    config = spec.config
    if config.num_moe_experts is not None and config.moe_grouped_gemm and not transformer_engine:
        print(" > --moe-grouped-gemm: megatron-core's sequential experts instead (grouped GEMMs are Transformer "
              "Engine's, on a GPU); the same arithmetic per expert", flush=True)
    _print_fusions_off(spec, device_type)
    _print_local_stand_ins(spec, transformer_engine, device_type)
    _print_context_parallel_attention(spec, transformer_engine)


def _print_context_parallel_attention(spec: ModelSpec, transformer_engine: bool) -> None:
    """With context parallelism, which attention runs the split sequence (model/context_parallel.py)."""
    config = spec.config
    if config.context_parallel_size == 1:
        return
    kinds = config.cp_comm_type if isinstance(config.cp_comm_type, list) else [config.cp_comm_type]
    kinds = " ".join(dict.fromkeys(kinds))
    if transformer_engine:
        print(f" > context parallelism (CP={config.context_parallel_size}): Transformer Engine's attention, "
              f"--cp-comm-type {kinds}", flush=True)
        return
    print(f" > context parallelism (CP={config.context_parallel_size}): megatron-core's local attention over keys "
          f"and values all-gathered from the CP ranks (Transformer Engine's all_gather type computes the same; "
          f"here --cp-comm-type {kinds} computes it too)", flush=True)


def _print_local_stand_ins(spec: ModelSpec, transformer_engine: bool, device_type: str) -> None:
    """Once, what two MoE and recomputation flags do here that differs from a GPU run with Transformer Engine
    (model/chunk.py's ``te_only_recompute`` and ``shared_expert_overlap``)."""
    te_only, config = te_only_recompute(spec, transformer_engine), spec.config
    if te_only and config.recompute_granularity == "selective":
        rest = [m for m in config.recompute_modules if m not in te_only]
        print(f" > --recompute-modules: {', '.join(te_only)} only in Transformer Engine's layers (no effect with "
              f"megatron-core's local layers here); recomputed: {', '.join(rest) or 'none of the others'}", flush=True)
    if (config.moe_shared_expert_overlap and config.moe_shared_expert_intermediate_size
            and not shared_expert_overlap(spec, device_type)):
        print(" > --moe-shared-expert-overlap: off on the CPU (megatron-core overlaps the shared experts with the "
              "token dispatch on a CUDA stream); they run before the router instead, computing the same", flush=True)


def _print_fusions_off(spec: ModelSpec, device_type: str) -> None:
    """One line for every fusion Megatron-LM would run with these flags that stays off here, by reason
    (model/chunk.py's ``fusions_off``): all of them on the CPU."""
    reasons: dict[str, list[str]] = {}
    for field, reason in fusions_off(spec, device_type).items():
        reasons.setdefault(reason, []).append(field)
    if reasons:
        print(" > fusions kept off: " + "; ".join(f"{', '.join(fields)} ({reason})"
                                                  for reason, fields in reasons.items()), flush=True)


def print_layout(plan) -> None:
    """Once, by rank 0, for a pipelined model: the layout in Megatron-LM's spelling (reusable with
    --pipeline-model-parallel-layout) and what each model stage holds."""
    if dist.get_rank() != 0 or plan.model_stages == 1:
        return
    given = "balanced for " + plan.balanced_for if plan.balanced_for else "as given"
    print(f" > pipeline layout {plan.layout} ({given}): {plan.layout.describe()}", flush=True)


def print_halves(plan) -> None:
    """Once, by rank 0: how --overlap-moe-expert-parallel-comm halves a micro-batch that does not split along
    its batch (config/schedule_request.py's ``halves_note``)."""
    if dist.get_rank() == 0 and plan.halves_note is not None:
        print(f" > {plan.halves_note}", flush=True)


def print_ramp(plans: dict, data: DataSpec) -> None:
    """Once, by rank 0, under a batch-size ramp: each step's first sample, its global batch size, and the
    schedule that runs it (``plans``: by global batch size, each proven above)."""
    if dist.get_rank() != 0 or not data.batch_steps:
        return
    steps = "; ".join(f"from sample {first}: global batch size {size} ({_plan_name(plans[size])}, "
                      f"N={plans[size].microbatches})"
                      for first, size in data.batch_steps)
    print(f" > batch-size ramp, {len(data.batch_steps)} schedules: {steps}", flush=True)


def _plan_name(plan) -> str:
    return plan.name if plan.lowered is None else plan.lowered.name


def print_global_aux_loss(spec: ModelSpec, rt) -> None:
    """Once, by rank 0, where the model has several copies along the pipeline dimension: megatron-core's
    global auxiliary loss averages each router's token counts over the micro-batches that router has run in
    the iteration, and each copy runs only its own pipeline's (docs/moe.md says how that differs)."""
    balancing = spec.config.moe_router_load_balancing_type
    balancing = [balancing] if isinstance(balancing, str) else balancing
    if dist.get_rank() != 0 or rt.pipelines == 1 or "global_aux_loss" not in balancing:
        return
    print(f" > global_aux_loss over {rt.pipelines} pipelines: each copy of a stage counts tokens per expert over "
          "its own pipeline's micro-batches of the iteration, where one process counts every micro-batch before "
          "it; the loss differs from one process's (docs/moe.md)", flush=True)


def print_parameter_counts(chunks: dict, rt) -> None:
    """As Megatron-LM, from data- and context-parallel rank 0: one line per chunk, the worker as the pipeline rank;
    where the model has several copies (pipelines) or the rank several chunks, which one."""
    if rt.dp_rank != 0 or rt.cp_rank != 0:
        return
    for (pipeline, stage), chunk in chunks.items():
        count = sum(p.numel() for p in chunk.parameters())
        copy = f" (pipeline {pipeline}, stage {stage})" if rt.pipelines > 1 or len(chunks) > 1 else ""
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({rt.tp_rank}, {rt.worker}): "
              f"{count}{copy}", flush=True)


def print_schedule_proof(plan, digest: str) -> None:
    """Once, by rank 0: what was proven before iteration 1, how long it took, and the schedule every
    rank agreed on."""
    if dist.get_rank() != 0 or plan.lowered is None:
        return
    s = plan.lowered
    print(f" > schedule {s.name} (D={s.depth}, N={s.microbatches}, {digest} on every rank): its training and "
          f"forward-only lists complete under NCCL's rules ({PROOF_MODE}), proven in {plan.proof_seconds:.2f} s",
          flush=True)


def print_warm_up(warmed, seconds: float, rt) -> None:
    """Once, by rank 0: the communicators created before iteration 1, the most on any rank, and how
    many collective ones there would be if groups with one rank set did not share one (collective:
    every rank calls it)."""
    counts = torch.tensor([warmed.collectives, warmed.unshared, len(warmed.pairs)], device=rt.comm_device or rt.device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f" > communicators created before iteration 1: up to {int(counts[0])} collective groups "
              f"({int(counts[1])} without sharing) and {int(counts[2])} p2p pairs per rank, in {seconds:.2f} s",
              flush=True)


FIELDS = ("parameters", "main parameters", "gradients", "optimizer")


def print_model_state(mine: ModelStateBytes, per_rank: bool) -> None:
    """This rank's model state (optim/optimizer.py counts it): one line per rank with --log-memory-per-rank
    (``per_rank``); otherwise, printed once, the rank with the most. Collective."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(mine))
    fields = lambda b: " | ".join(f"{k}: {v}" for k, v in zip(FIELDS, b)) + f" | total: {sum(b)}"  # noqa: E731
    if per_rank:
        print(f"rank {dist.get_rank()} model state (bytes) | {fields(mine)}", flush=True)
    elif dist.get_rank() == 0:
        print(f"max model state (bytes) | {fields(max(everyone, key=sum))}", flush=True)
