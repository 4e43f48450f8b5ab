"""The flags as a pipeline request: which schedule, its options as a ScheduleSpec
(chimera_schedules/ir/spec.py), the model stages it runs and the layers each holds.

Pure functions of Megatron-LM's namespace, and cheap: validation's rules (schedule_rules.py) ask them
while parsing, and ``PipelineSpec.from_args`` (pipeline_spec.py) asks them once more to build the
section the run plan is made from. Nothing here writes to the namespace: --pipeline-schedule stays as
given, and ``resolved_schedule`` says what it resolves to.
"""
from __future__ import annotations

import torch

from chimera_schedules import ScheduleSpec
from chimera_schedules.ir import layout as layouts
from chimera_schedules.ir.actions import BATCH, SEQUENCE, HalvesSplit
from chimera_schedules.ir.layout import Layout
from chimera_schedules.ir.spec import OPTION, SHARED
from chimera_schedules.registry import REGISTRY

MEGATRON_SCHEDULES = ("megatron-1f1b", "megatron-interleaved")
INTERLEAVED = ("interleaved", "megatron-interleaved")  # megatron's round-robin placement of v chunks per rank


def resolved_schedule(args) -> str:
    """--pipeline-schedule, or Megatron-LM's choice when it is not given: its interleaved schedule with
    virtual stages (or a layout of more stages than PP), else its 1F1B."""
    if args.pipeline_schedule is not None:
        return args.pipeline_schedule
    text, pp = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    more_stages = text is not None and len(layouts.parse(text).stages) > pp
    chunks = args.num_layers_per_virtual_pipeline_stage or (args.num_virtual_stages_per_pipeline_rank or 0) > 1
    return "megatron-interleaved" if chunks or more_stages else "megatron-1f1b"


def microbatches(args) -> int:
    """Micro-batches per iteration and pipeline replica: the global batch over micro-batch size x DP."""
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def given_options(args) -> dict:
    """The schedule options the trainer takes as they are, by ScheduleSpec field; None if not given."""
    return {field: getattr(args, flag_dest(OPTION[field].trainer)) for field in SHARED}


def interleaved_chunks(args) -> int | None:
    """Model chunks per rank that --num-layers-per-virtual-pipeline-stage (or, with uneven first and last
    stages, --num-virtual-stages-per-pipeline-rank) gives, if set; under the interleaved schedules, a
    --pipeline-model-parallel-layout's stages over PP (Megatron-LM's rule)."""
    text, pp = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    if text is not None and resolved_schedule(args) in INTERLEAVED:
        return max(1, len(layouts.parse(text).stages) // pp)
    if args.num_virtual_stages_per_pipeline_rank:  # kept only with first/last counts (megatron_namespace.py)
        return args.num_virtual_stages_per_pipeline_rank
    v = args.num_layers_per_virtual_pipeline_stage
    return args.num_layers // (args.pipeline_model_parallel_size * v) if v else None


def schedule_request(args) -> ScheduleSpec | None:
    """The request our executor's schedule is built from, as the flags give it (the registry checks it
    and fills in its defaults); None for megatron-core's schedules and for a single stage."""
    name = resolved_schedule(args)
    if name not in REGISTRY or args.pipeline_model_parallel_size == 1:
        return None
    options = given_options(args)
    if args.overlap_moe_expert_parallel_comm and halves_split(args) is None:
        options["halves"] = False  # pairs only (docs/moe.md): a micro-batch that does not split exactly
    virtual = interleaved_chunks(args) if "virtual_stages" in REGISTRY[name].options else None
    return ScheduleSpec(name, args.pipeline_model_parallel_size, microbatches(args), virtual_stages=virtual,
                        overlap=args.overlap_moe_expert_parallel_comm or None, **options)


def halves_split(args) -> HalvesSplit | None:
    """Where the micro-batches the schedule runs split into two halves exactly: along the batch at an even
    size (--micro-batch-size, halved again under --chimera-concat halving), else along each sequence
    (``sequence_split_refusal``); None where neither does, or where the router's statistics are the whole
    micro-batch's (``whole_batch_statistics``)."""
    if whole_batch_statistics(args):
        return None
    size = args.micro_batch_size // (2 if args.chimera_concat == "halving" else 1)
    if size >= 2 and size % 2 == 0:
        return BATCH
    return SEQUENCE if sequence_split_refusal(args) is None else None


def sequence_split_refusal(args) -> str | None:
    """Why a sequence does not run as its two halves exactly here (model/sequence_halves.py), naming the
    flag; None where it does."""
    kinds = args.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    coeffs = args.moe_aux_loss_coeff
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(kinds)
    modules = args.recompute_modules or ["core_attn"]
    recomputed = args.recompute_granularity == "selective" and ({"core_attn", "mla_up_proj"} & set(modules))
    reasons = (
        (args.seq_length % 2, f"--seq-length {args.seq_length} is odd"),
        (args.context_parallel_size > 1, "--context-parallel-size: a CP rank's two chunks of the sequence are not "
                                         "split again"),
        (args.sequence_parallel, "--sequence-parallel: a tensor-parallel rank holds a slice of the sequence, whose "
                                 "halves are not the sequence's"),
        (any(kind == "seq_aux_loss" and coeff for kind, coeff in zip(kinds, coeffs)),
         "--moe-router-load-balancing-type seq_aux_loss: a statistic of the whole sequence, which neither half holds"),
        (args.window_size is not None, "--window-size: sliding-window attention builds its own mask"),
        (recomputed, "--recompute-modules core_attn or mla_up_proj: recomputing runs the core attention twice, or "
                     "frees the keys and values the second half reads"),
        (args.transformer_impl == "transformer_engine" and torch.cuda.is_available(),
         "--transformer-impl transformer_engine: its attention is not hooked for halves yet (--transformer-impl "
         "local is)"),
    )
    return next((reason for refused, reason in reasons if refused), None)


def halves_note(args) -> str | None:
    """The startup line saying how --overlap-moe-expert-parallel-comm halves a micro-batch that does not split
    along its batch: along its sequence, or not at all and why; None otherwise."""
    if not args.overlap_moe_expert_parallel_comm or halves_split(args) is BATCH or args.no_overlap_moe_halves is False:
        return None
    size = args.micro_batch_size // (2 if args.chimera_concat == "halving" else 1)
    whole = whole_batch_statistics(args)
    if halves_split(args) is SEQUENCE:
        return (f"--overlap-moe-expert-parallel-comm: micro-batches of {size} run an unpaired pass as the first and "
                "second half of each sequence, each half's all-to-all beside the other's compute")
    why = f"{whole[0]}: a statistic of the whole micro-batch" if whole else sequence_split_refusal(args)
    return f"--overlap-moe-expert-parallel-comm: no halves, pairs only ({why})"


def whole_batch_statistics(args) -> list[str]:
    """The flags whose statistics are computed from a whole micro-batch's tokens together, which two halves
    cannot reproduce: --moe-router-load-balancing-type aux_loss or global_aux_loss (with a coefficient)
    and sinkhorn (which routes each token by all the others), --moe-expert-capacity-factor (a capacity of
    the whole micro-batch's), and --mtp-num-layers (megatron-core normalises the MTP loss by the tokens of
    the pass that computes it, a half's where the main loss counts the whole's). Means over tokens or
    sequences (z-loss, seq_aux_loss) and token counts (expert bias) are the whole's from its halves
    (model/schedule_plan.py)."""
    kinds = args.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    coeffs = args.moe_aux_loss_coeff
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(kinds)
    whole = [f"--moe-router-load-balancing-type {kind}" for kind, coeff in zip(kinds, coeffs)
             if kind == "sinkhorn" or kind in ("aux_loss", "global_aux_loss") and coeff]
    return whole + (["--moe-expert-capacity-factor"] if args.moe_expert_capacity_factor is not None else []) + (
        ["--mtp-num-layers"] if args.mtp_num_layers else [])


def model_stages(args, request: ScheduleSpec | None) -> int:
    """Model stages per pipeline: PP times the stages per worker and pipeline that the registry gives
    the schedule (megatron-core's interleaved one: its chunks per rank). Known before the request is
    checked, so a --num-layers that does not divide is named first."""
    pp = args.pipeline_model_parallel_size
    if request is not None:
        return pp * REGISTRY[request.schedule].virtual_stages(request)
    return pp * (interleaved_chunks(args) or 1) if resolved_schedule(args) == "megatron-interleaved" else pp


def stage_layout(args, stages: int) -> Layout:
    """The layers each of the ``stages`` model stages holds, as Megatron-LM's five layout flags ask
    (checked: ConfigError naming the flag). Under the interleaved schedules the first and last layer
    counts are a pipeline rank's, spread over its chunks, as in megatron-core."""
    per_rank = stages // args.pipeline_model_parallel_size if resolved_schedule(args) in INTERLEAVED else 1
    return layouts.from_flags(args.num_layers, stages, args.mtp_num_layers or 0, args.pipeline_model_parallel_layout,
                              args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                              args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split,
                              per_rank)


def flag_dest(flag: str) -> str:
    """The namespace attribute argparse stores ``flag`` in."""
    return flag.lstrip("-").replace("-", "_")


def schedule_flags(spec: ScheduleSpec, num_layers: int) -> list[str]:
    """The flags that make the trainer build ``spec`` for a model of ``num_layers``, given a global batch
    that gives its micro-batches (the benchmark runs the registry's variants with these)."""
    out = ["--pipeline-model-parallel-size", str(spec.depth), "--pipeline-schedule", spec.schedule]
    if spec.virtual_stages:
        out += [OPTION["virtual_stages"].trainer, str(num_layers // (spec.depth * spec.virtual_stages))]
    for field in (*SHARED, "overlap"):
        value = getattr(spec, field)
        if isinstance(value, bool):  # a switch: its flag when the value is not its default
            out += [OPTION[field].trainer] if value is not bool(OPTION[field].default) else []
        elif value is not None:
            out += [OPTION[field].trainer, str(value)]
    return out
