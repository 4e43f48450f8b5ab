"""The schedule's rules: its options, virtual stages and layout flags, the model stages it cuts --num-layers
into, what it runs with (MTP, --overlap-moe-expert-parallel-comm, a split backward, recomputation, the
torch checkpoint format), and the registry's check of the request, each naming the flag the user gave.
The run plan is built from the same request after parsing (pipeline_spec.py, run_plan.py)."""
from __future__ import annotations

from functools import partial

import torch

from chimera_schedules import ConfigError, ScheduleSpec, check
from chimera_schedules.ir.errors import require
from chimera_schedules.ir.spec import OPTION
from chimera_schedules.registry import check_options

from .balanced_layout import balanced_layout
from .layer_probes import TransformerEngine
from .run_plan import generated
from .schedule_request import (
    INTERLEAVED,
    flag_dest,
    given_options,
    model_stages,
    resolved_schedule,
    schedule_request,
    stage_layout,
)


def check_schedule(args, transformer_engine: TransformerEngine) -> None:
    """The schedule's options and rules, and the model stages it cuts --num-layers into.
    ``transformer_engine`` (layer_probes.py) says whether this machine's layers can split a backward."""
    pp, name = args.pipeline_model_parallel_size, resolved_schedule(args)
    check_options(name, given_options(args))
    _check_virtual_stages(args, name)
    request = schedule_request(args)
    stages = model_stages(args, request)
    if args.save and args.ckpt_format == "torch":  # legacy_save.py: Megatron-LM's per-rank files
        require(stages == pp, "--ckpt-format", "torch", f"--pipeline-schedule {name} runs {stages} model stages on "
                f"{pp} pipeline ranks; Megatron-LM's torch format holds one stage per rank (save torch_dist)")
        require(args.expert_model_parallel_size == 1, "--ckpt-format", "torch",
                "is not written with --expert-model-parallel-size > 1 (save torch_dist)")
    if args.balance_pipeline_layout:  # stored as Megatron-LM's flag: the startup line and checkpoint read it
        args.pipeline_model_parallel_layout = str(balanced_layout(args, stages, request))
    _check_mtp(args, stage_layout(args, stages), request)
    _check_overlap(args, request)
    if request is not None:
        _check_request(args, request)
        _check_split_backward(args, request, transformer_engine)
        _check_recompute_split(args, request)
    if args.chimera_concat == "halving":
        require(args.micro_batch_size % 2 == 0, "--micro-batch-size", args.micro_batch_size,
                "must be even for --chimera-concat halving (it runs half-size micro-batches)")


def _check_virtual_stages(args, name: str) -> None:
    """Virtual stages (chunks per rank) under the interleaved schedules only, in one of Megatron-LM's
    spellings; megatron-core's interleaved schedule deeper than 2."""
    pp = args.pipeline_model_parallel_size
    v, text = args.num_layers_per_virtual_pipeline_stage, args.pipeline_model_parallel_layout
    if name in INTERLEAVED:
        chunks = args.num_virtual_stages_per_pipeline_rank
        require(v is not None and v > 0 or text is not None or chunks, "--num-layers-per-virtual-pipeline-stage", v,
                f"--pipeline-schedule {name} needs it (or --num-virtual-stages-per-pipeline-rank, or "
                "--pipeline-model-parallel-layout)")
        require(v is None or args.num_layers % (pp * v) == 0, "--num-layers-per-virtual-pipeline-stage", v,
                f"PP x it must divide --num-layers ({args.num_layers})")
        if name == "megatron-interleaved":
            require(pp > 2, "--pipeline-model-parallel-size", pp, "megatron-core's interleaved schedule needs more "
                    "than 2 stages (at 2 its batched p2p pairs activations and gradients on one channel); "
                    "--pipeline-schedule interleaved runs at any depth")
    else:
        require(v is None, "--num-layers-per-virtual-pipeline-stage", v, "applies to the interleaved schedules only")
        chunks = args.num_virtual_stages_per_pipeline_rank
        require(not chunks or chunks == 1, "--num-virtual-stages-per-pipeline-rank", chunks,
                "applies to the interleaved schedules only")
    require(v is None or text is None, "--pipeline-model-parallel-layout", text,
            "cannot be combined with --num-layers-per-virtual-pipeline-stage (Megatron-LM's rule)")


OVERLAP_FLAG = "--overlap-moe-expert-parallel-comm"


def _check_overlap(args, request: ScheduleSpec | None) -> None:
    """--overlap-moe-expert-parallel-comm under megatron-core's rules for it (TransformerConfig's), less two
    that its combined 1F1B needs and our executor does not: it runs in fp32 too (the exactness tests need
    it) and without virtual stages (our schedules pair the actions themselves). The field is therefore not
    passed to megatron-core's config; the schedule's overlap pass and the executor's schedule plans are
    what the flag turns on."""
    if not args.overlap_moe_expert_parallel_comm:
        return
    needs = partial(require, False, OVERLAP_FLAG, True)
    if request is None:
        needs(f"pairs the actions of our executor's schedules: give --pipeline-schedule 1f1b, chimera, dualpipe "
              f"or dualpipev with --pipeline-model-parallel-size > 1 (got {resolved_schedule(args)} at "
              f"PP={args.pipeline_model_parallel_size})")
    if args.expert_model_parallel_size < 2:
        needs("hides the expert-parallel all-to-all behind another micro-batch's compute: it needs "
              f"--expert-model-parallel-size > 1 (got {args.expert_model_parallel_size})")
    if args.moe_token_dispatcher_type != "alltoall":
        needs("splits each MoE layer at its dispatch and combine all-to-alls, which the "
              f"{args.moe_token_dispatcher_type} dispatcher does not have: give --moe-token-dispatcher-type alltoall")
    recompute = (args.recompute_granularity == "full" or args.moe_layer_recompute
                 or "moe" in (args.recompute_modules or []))
    if recompute:
        needs("runs a layer's parts one by one, which recomputing the whole layer or its MoE block cannot "
              "(megatron-core's rule): drop --recompute-granularity full, --moe-layer-recompute and "
              "--recompute-modules moe")
    if args.moe_shared_expert_overlap:
        needs("and --moe-shared-expert-overlap exclude each other (megatron-core's rule): drop one")


def _check_split_backward(args, request: ScheduleSpec, te: TransformerEngine) -> None:
    """A schedule with a split backward (I and W passes: asked with --split-backward, or DualPipe's own)
    runs Transformer Engine's layers with their weight gradients delayed to W (delay_wgrad_compute and
    backward_dw(), from the release ``te.delayed_wgrad_te`` names); with an older one, it is refused."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    wgrad = args.overlap_grad_reduce, args.gradient_accumulation_fusion
    if (not te.uses_transformer_engine(args.transformer_impl, device_type) or te.delays_weight_gradients(*wgrad)
            or request.overlap):
        return  # with --overlap-moe-expert-parallel-comm the schedule plan splits the backward itself
    asked = " --split-backward" if request.split_backward else ""
    require(not _splits_backward(request), "--transformer-impl", args.transformer_impl,
            f"Transformer Engine's fused linears compute the input and weight gradients together, which "
            f"--pipeline-schedule {request.schedule}{asked} separates: that needs Transformer Engine "
            f"{te.delayed_wgrad_te(*wgrad)} or later (delay_wgrad_compute under these flags; installed: "
            f"{te.transformer_engine_version()}); "
            "upgrade it, or give --transformer-impl local")


def _splits_backward(request: ScheduleSpec) -> bool:
    """Whether the schedule splits its backward, read from its IR as the run plan reads it (generated here,
    for the run plan too, only for the rules that ask: an older Transformer Engine, recomputation)."""
    return bool(request.split_backward or generated(request).split_backward)


def _check_recompute_split(args, request: ScheduleSpec) -> None:
    """megatron-core's activation recomputation (--recompute-granularity, --recompute-activations,
    --moe-layer-recompute) reruns a forward inside a whole backward only: it raises "Checkpointing is not
    compatible with .grad()" in a backward restricted to some tensors, which both passes of a split
    backward are (I asks the stage input's gradient, W the weights'). Refused here, before anything starts."""
    flag = ("--recompute-granularity" if args.recompute_granularity
            else "--moe-layer-recompute" if args.moe_layer_recompute else None)
    if flag is None:
        return
    asked = " --split-backward" if request.split_backward else ""
    require(not _splits_backward(request), flag, args.recompute_granularity or True,
            f"megatron-core's activation recomputation runs in a whole backward only, which --pipeline-schedule "
            f"{request.schedule}{asked} splits into input- and weight-gradient passes: drop one of the two")


def _check_mtp(args, held, request) -> None:
    """Multi-token prediction: where the layout puts it, under what the run can carry."""
    if not args.mtp_num_layers:
        return
    require(not args.fp16, "--fp16", True, "with --mtp-num-layers is not supported yet (the MTP loss is not "
            "loss-scaled): give --bf16")
    alone = any(s.mtp and not s.loss for s in held.stages)
    require(not alone or request is not None, "--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout,
            f"puts MTP on a stage of its own, whose output (1 + --mtp-num-layers activations) megatron-core's "
            f"{resolved_schedule(args)} schedule cannot send (its messages have one shape): put m with L, or run "
            "one of our schedules")


def _check_request(args, request: ScheduleSpec) -> None:
    """The registry's check of the request. An error about a value the trainer derives (micro-batches
    from --global-batch-size) names the flag the user gave, and says what it gives."""
    try:
        check(request)
    except ConfigError as e:
        option = OPTION.get(e.option)
        if option is None or not option.trainer_derives:
            raise
        rule = f"gives {e.value} {option.trainer_derives}; {e.rule}"
        raise ConfigError(option.trainer, getattr(args, flag_dest(option.trainer)), rule) from None
