"""Megatron-LM's own fields around its validate_args: its other spellings read as validate_args reads them
(our rules run first, so that each names its flag), and the namespace held still while validate_args runs,
where our derived values and layout flags would trip its own rules."""
from __future__ import annotations

from chimera_schedules.ir.errors import require

from .parser import megatron_validate

# Megatron-LM's layout flags: validate_args reads them for megatron-core's placement (PP ranks), ours
# for the schedule's model stages (schedule_request.stage_layout), so they wait aside while it runs
LAYOUT_DESTS = ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split")


def validate_args_as_given(args) -> None:
    """validate_args sees the flags as given: with --train-samples, Megatron-LM derives the iteration
    count only when training starts, so ours (derived earlier, for the schedule) waits aside; so do
    the layout flags (LAYOUT_DESTS)."""
    derived = args.train_iters if args.train_samples else None
    if derived:
        args.train_iters = None
    hidden = {dest: getattr(args, dest) for dest in LAYOUT_DESTS}  # ours are the rules for these (schedule_request)
    for dest, value in hidden.items():
        setattr(args, dest, False if isinstance(value, bool) else None)
    if args.num_layers % args.pipeline_model_parallel_size and args.num_layers_per_virtual_pipeline_stage is None:
        # validate_args asks an even split of --num-layers over PP unless an uneven flag is given; the
        # layout, checked by our rules, is uneven, so it reads as such
        args.decoder_first_pipeline_num_layers = hidden["decoder_first_pipeline_num_layers"] or 0
    megatron_validate(args)
    for dest, value in hidden.items():
        setattr(args, dest, value)
    if derived:
        args.train_iters = derived


def read_megatron_spellings(args) -> None:
    """Megatron-LM's other spellings, read as its validate_args reads them (which runs after our
    rules): --recompute-activations, --num-virtual-stages-per-pipeline-rank, sequence parallelism
    off at TP=1."""
    if args.recompute_activations:
        require(args.recompute_granularity in (None, "selective"), "--recompute-activations", True,
                f"means --recompute-granularity selective, not {args.recompute_granularity}")
        args.recompute_granularity = "selective"
    v, pp = args.num_virtual_stages_per_pipeline_rank, args.pipeline_model_parallel_size
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    if v is not None and not uneven:
        require(args.num_layers_per_virtual_pipeline_stage is None and v > 0 and args.num_layers % (pp * v) == 0,
                "--num-virtual-stages-per-pipeline-rank", v, f"PP x it must divide --num-layers ({args.num_layers}), "
                "without --num-layers-per-virtual-pipeline-stage")
        if v > 1:
            args.num_layers_per_virtual_pipeline_stage = args.num_layers // (pp * v)
        args.num_virtual_stages_per_pipeline_rank = None  # one spelling for validate_args, as it demands
    elif v is not None:  # Megatron-LM's uneven interleaving keeps this spelling; the layout checks the counts
        require(args.num_layers_per_virtual_pipeline_stage is None and v > 0, "--num-virtual-stages-per-pipeline-rank",
                v, "must be positive, without --num-layers-per-virtual-pipeline-stage")
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # Megatron-LM's rule: nothing to split
    require(not args.sequence_parallel or args.seq_length % args.tensor_model_parallel_size == 0,
            "--sequence-parallel", True, f"needs --seq-length divisible by TP ({args.tensor_model_parallel_size})")
