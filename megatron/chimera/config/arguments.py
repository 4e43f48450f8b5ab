"""pretrain_gpt.py's checks of what the flags ask for, after Megatron-LM's parser (``parser``).

``parse_args`` validates everything that can be known before a process group exists, so an
impossible layout fails at once with one line naming the flag and the rule (exit code 2). Our rules
run before Megatron-LM's ``validate_args``, so a layout error names the flag; the checks that need
its derived settings (FFN width, query groups) and the checkpoint's run after it."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.optimizer.emerging_optimizers import get_supported_coefficient_types
from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
from megatron.training.checkpointing import load_args_from_checkpoint

from chimera_schedules import ConfigError, ScheduleSpec, check
from chimera_schedules.ir.errors import require
from chimera_schedules.ir.spec import OPTION, SHARED, flags
from chimera_schedules.registry import check_options

from ..checkpoint.checkpointing import LATEST, check_shape, check_sizes, find_checkpoint, read_common
from ..checkpoint.integrity import unverifiable
from ..data.tokenizer import build_tokenizer, check_fim_tokens, check_padded_vocab, default_type
from ..data.tokenizer import check_arguments as check_tokenizer_arguments
from ..model.chunk import (
    delayed_wgrad_te,
    delays_weight_gradients,
    transformer_engine_version,
    uses_transformer_engine,
)
from .balanced_layout import balanced_layout
from .data_spec import FimSpec, TokenizerSpec
from .parser import PROG, enforce_classes, fail, megatron_validate, parse
from .run_plan import (
    INTERLEAVED,
    flag_dest,
    generated,
    given_options,
    model_stages,
    resolved_schedule,
    schedule_request,
    stage_layout,
)

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
            "micro_batch_size", "lr")


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate. Exits with code 2 and one line on an impossible configuration."""
    args, parser = parse(argv)
    args.world_size = world_size or args.world_size
    try:
        if args.use_checkpoint_args:
            _checkpoint_args(args)
        enforce_classes(args, parser, sys.argv[1:] if argv is None else argv)
        _validate(args)
        _megatron_validate(args)
        _validate_architecture(args)
        if args.load:
            _validate_checkpoint(args)
    except ConfigError as e:
        fail(f"{PROG}: error: {e.message(flags('trainer'))}")
    return args


# Megatron-LM's layout flags: validate_args reads them for megatron-core's placement (PP ranks), ours
# for the schedule's model stages (run_plan.stage_layout), so they wait aside while it runs
LAYOUT_DESTS = ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split")


def _megatron_validate(args) -> None:
    """validate_args sees the flags as given: with --train-samples, Megatron-LM derives the iteration
    count only when training starts, so ours (derived earlier, for the schedule) waits aside; so do
    the layout flags (LAYOUT_DESTS)."""
    derived = args.train_iters if args.train_samples else None
    if derived:
        args.train_iters = None
    hidden = {dest: getattr(args, dest) for dest in LAYOUT_DESTS}  # ours are the rules for these (run_plan)
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


def _validate_precision(args) -> None:
    require(not (args.fp16 and args.bf16), "--fp16", True, "give one of --fp16 and --bf16")
    require(not args.overlap_param_gather or args.use_distributed_optimizer, "--overlap-param-gather", True,
            "needs --use-distributed-optimizer (Megatron-LM's rule)")
    require(not (args.ddp_average_in_collective and args.calculate_per_token_loss), "--ddp-average-in-collective",
            True, "cannot be combined with --calculate-per-token-loss (megatron-core's rule)")
    for flag, value in (("--initial-loss-scale", args.initial_loss_scale), ("--min-loss-scale", args.min_loss_scale),
                        ("--loss-scale-window", args.loss_scale_window), ("--hysteresis", args.hysteresis),
                        ("--loss-scale", args.loss_scale or 1)):
        require(value > 0, flag, value, "must be positive")
    require(args.min_loss_scale <= args.initial_loss_scale, "--min-loss-scale", args.min_loss_scale,
            f"must not exceed --initial-loss-scale ({args.initial_loss_scale:g})")


def _validate(args) -> None:
    _validate_sizes(args)
    _expert_layout(args)
    _optimizer_instances(args)
    _muon(args)
    _training_length(args)
    _megatron_spellings(args)
    _validate_run(args)
    _validate_series(args)
    _check_tokenizer(args)
    _validate_layout(args)


def _check_tokenizer(args) -> None:
    """Megatron-LM's padded vocabulary, decided here once: --padded-vocab-size as given, else the tokenizer's
    ids rounded up to a multiple of --make-vocab-size-divisible-by x TP (megatron-core's builder sets it so
    for its tokenizers; GPT2BPETokenizer is ours). With --fim-data, the tokenizer holds its tokens."""
    spec = TokenizerSpec.from_args(args)
    tokenizer = build_tokenizer(spec, args)
    if args.pad_vocab_size and args.padded_vocab_size is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    check_padded_vocab(args.padded_vocab_size, args.tensor_model_parallel_size, tokenizer, require)
    check_fim_tokens(FimSpec.from_args(args), spec.kind, tokenizer, require)


def _expert_layout(args) -> None:
    """Before Megatron-LM's validate_args, whose assertions name no flag: experts split evenly over
    expert-parallel ranks, and the expert groups (--expert-tensor-parallel-size x --expert-model-parallel-size,
    ETP defaulting to TP as in Megatron-LM) tiling each pipeline stage's TP x DP ranks."""
    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    require(ep > 0 and etp > 0, "--expert-model-parallel-size", ep,
            "and --expert-tensor-parallel-size must be positive")
    require(ep == 1 or args.num_experts is not None, "--expert-model-parallel-size", ep, "needs --num-experts")
    if args.num_experts is None:
        return
    require(args.num_experts % ep == 0, "--num-experts", args.num_experts,
            f"must be a multiple of --expert-model-parallel-size ({ep})")
    cp, dp = args.context_parallel_size, args.data_parallel_size
    require((tp * cp * dp) % (etp * ep) == 0, "--expert-model-parallel-size", ep,
            f"x --expert-tensor-parallel-size ({etp}) must divide TP x CP x DP = {tp} x {cp} x {dp} "
            "(megatron-core's rule: the expert groups tile each pipeline stage's ranks)")
    attention = tp * args.context_parallel_size
    require(not args.use_tp_pp_dp_mapping or args.pipeline_model_parallel_size == 1 or etp * ep == attention,
            "--use-tp-pp-dp-mapping", True, f"needs --expert-tensor-parallel-size x --expert-model-parallel-size "
            f"= TP x CP ({attention}) (megatron-core's rule: the same data-parallel size for experts)")
    _routing(args)


def _optimizer_instances(args) -> None:
    """--num-distributed-optimizer-instances splits every data-parallel group (the expert ones too) into
    that many equal instances (megatron-core's rule, which its assertions state without the flag)."""
    k, dp = args.num_distributed_optimizer_instances, args.data_parallel_size
    require(k > 0 and dp % k == 0, "--num-distributed-optimizer-instances", k,
            f"must divide the data-parallel size ({dp})")
    require(k == 1 or args.use_distributed_optimizer, "--num-distributed-optimizer-instances", k,
            "needs --use-distributed-optimizer (megatron-core's rule)")
    if args.num_experts is not None:
        experts = args.expert_tensor_parallel_size * args.expert_model_parallel_size
        edp = args.tensor_model_parallel_size * args.context_parallel_size * dp // experts
        require(edp % k == 0, "--num-distributed-optimizer-instances", k,
                f"must divide the expert data-parallel size ({edp})")


def _muon(args) -> None:
    """--optimizer muon as megatron-core builds it (optim/muon.py), before validate_args turns
    --use-distributed-optimizer into its layer-wise distributed optimizer (optim/layer_wise.py)."""
    if args.optimizer != "muon":
        return
    require(not args.fp16, "--fp16", True, "cannot be combined with --optimizer muon (megatron-core's rule: "
            "emerging optimizer with fp16 is not supported)")
    unsupported = "with --optimizer muon is not implemented (Muon's layer-wise distributed optimizer gathers " \
                  "the weights after the step)"
    require(not args.overlap_param_gather, "--overlap-param-gather", True, unsupported)
    require(args.num_distributed_optimizer_instances == 1, "--num-distributed-optimizer-instances",
            args.num_distributed_optimizer_instances, unsupported)
    require(args.muon_num_ns_steps >= 1, "--muon-num-ns-steps", args.muon_num_ns_steps, "must be at least 1")
    supported = get_supported_coefficient_types()
    require(args.muon_coefficient_type in supported, "--muon-coefficient-type", args.muon_coefficient_type,
            f"not one of the installed emerging-optimizers' types ({', '.join(supported)})")


def _routing(args) -> None:
    """Top-k within what the router can pick: all experts, or with group-limited routing the experts of
    the --moe-router-group-topk groups it selects (megatron-core's group_limited_topk)."""
    experts, k = args.num_experts, args.moe_router_topk
    groups, picked = args.moe_router_num_groups, args.moe_router_group_topk
    require(0 < k <= experts, "--moe-router-topk", k, f"must be between 1 and --num-experts ({experts})")
    if groups is None:
        return
    require(experts % groups == 0, "--moe-router-num-groups", groups, f"must divide --num-experts ({experts})")
    require(picked is not None and 0 < picked <= groups, "--moe-router-group-topk", picked,
            f"must be between 1 and --moe-router-num-groups ({groups})")
    require(k <= picked * (experts // groups), "--moe-router-topk", k,
            f"is greater than the experts in the {picked} selected groups of {experts // groups} experts each")


def _validate_sizes(args) -> None:
    """The sizes every other rule divides by: given, positive, and fitting the world; then the
    data-parallel size, the global batch (Megatron-LM's default: one micro-batch per data-parallel
    rank) and the micro-batches per pipeline replica."""
    for dest in REQUIRED:
        require(getattr(args, dest) is not None, "--" + dest.replace("_", "-"), None, "is required")
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                 "micro_batch_size", "global_batch_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size"):
        value = getattr(args, dest)  # None: --global-batch-size's default, set below
        require(value is None or value > 0, "--" + dest.replace("_", "-"), value, "must be positive")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    require(cp > 0, "--context-parallel-size", cp, "must be positive")
    require(args.world_size % (tp * pp) == 0, "--pipeline-model-parallel-size", pp,
            f"TP x PP = {tp * pp} must divide the world size {args.world_size}")
    require(args.world_size % (tp * cp * pp) == 0, "--context-parallel-size", cp,
            f"TP x CP x PP = {tp * cp * pp} must divide the world size {args.world_size}")
    args.data_parallel_size = args.world_size // (tp * cp * pp)
    _context_parallel(args)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    require(args.global_batch_size % per_step == 0, "--global-batch-size", args.global_batch_size,
            f"must be a multiple of micro-batch size x data-parallel size = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step


# Transformer Engine's context-parallel communication types, which megatron-core hands it as given
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _context_parallel(args) -> None:
    """Megatron-LM's and megatron-core's rules for context parallelism (their assertions name no flag): the
    sequence in 2 x CP chunks (each CP rank holds chunk i and 2 x CP - 1 - i, which balances the causal
    attention's work), --hierarchical-context-parallel-sizes multiplying to CP (its groups need einops), a2a+p2p
    only with them, --cp-comm-type Transformer Engine's types, one or one per layer; and not MTP yet
    (docs/context-parallel.md)."""
    cp, sizes = args.context_parallel_size, args.hierarchical_context_parallel_sizes
    require(cp == 1 or args.seq_length % (2 * cp) == 0, "--seq-length", args.seq_length,
            f"must be a multiple of 2 x --context-parallel-size ({2 * cp}): the load-balanced split "
            "(Megatron-LM's rule)")
    require(sizes is None or math.prod(sizes) == cp, "--hierarchical-context-parallel-sizes", sizes,
            f"must multiply to --context-parallel-size ({cp}) (Megatron-LM's rule)")
    require(sizes is None or importlib.util.find_spec("einops") is not None, "--hierarchical-context-parallel-sizes",
            sizes, "needs the einops package, with which megatron-core 0.19 builds the hierarchical CP groups: "
            "pip install einops")
    for kind in args.cp_comm_type:
        require(kind in CP_COMM_TYPES, "--cp-comm-type", kind,
                f"is not one of Transformer Engine's types ({', '.join(CP_COMM_TYPES)})")
    require(cp == 1 or not args.mtp_num_layers, "--mtp-num-layers", args.mtp_num_layers,
            "with --context-parallel-size is not supported yet: megatron-core's MTP exchanges the sequence's chunk "
            "boundaries between CP ranks point to point on the world group, and the result is not yet exact here")
    layers = len(args.cp_comm_type)
    require(layers == 1 or layers == args.num_layers, "--cp-comm-type", " ".join(args.cp_comm_type),
            f"gives one type for all layers or one per layer ({args.num_layers}) (megatron-core's rule)")
    require(sizes is not None or not any("a2a+p2p" in kind for kind in args.cp_comm_type), "--cp-comm-type",
            " ".join(args.cp_comm_type), "a2a+p2p needs --hierarchical-context-parallel-sizes (Megatron-LM's rule)")


def _validate_run(args) -> None:
    """Intervals, rates, paths, data, precision and the run-time switches."""
    for flag, value in (("--log-interval", args.log_interval), ("--eval-interval", _or(args.eval_interval, 1)),
                        ("--save-interval", _or(args.save_interval, 1)),
                        ("--recompute-num-layers", _or(args.recompute_num_layers, 1)),
                        ("--distributed-timeout-minutes", args.distributed_timeout_minutes),
                        ("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by),
                        ("--max-consecutive-nan-iterations", args.max_consecutive_nan_iterations),
                        ("--exit-interval", args.exit_interval or 1),
                        ("--check-weight-hash-across-dp-replicas-interval",
                         _or(args.check_weight_hash_across_dp_replicas_interval, 1)),
                        ("--exit-duration-in-mins", args.exit_duration_in_mins or 1)):
        require(value > 0, flag, value, "must be positive")
    for flag, value in (("--eval-iters", args.eval_iters), ("--lr", args.lr), ("--min-lr", args.min_lr),
                        ("--lr-warmup-iters", args.lr_warmup_iters), ("--weight-decay", args.weight_decay),
                        ("--clip-grad", args.clip_grad), ("--hidden-dropout", args.hidden_dropout),
                        ("--attention-dropout", args.attention_dropout)):
        require(value >= 0, flag, value, "must not be negative")
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir)):
        if path:
            require(_writable(path), flag, path, "must be a writable directory, or creatable in a writable one")
    require(not args.save or args.save_interval, "--save-interval", args.save_interval,
            "is required with --save (Megatron-LM's rule)")
    require(args.ckpt_format == "torch_dist" or not args.save or args.no_save_optim, "--ckpt-format", args.ckpt_format,
            "is written without the optimizer state only (Megatron-LM keys it by its own parameter groups, which "
            "this trainer does not reproduce): add --no-save-optim, or save torch_dist")
    require(not args.verify_integrity or args.ckpt_format == "torch_dist", "--verify-integrity", True,
            "needs --ckpt-format torch_dist (Megatron-LM's rule: the torch format has no integrity manifest)")
    _validate_data(args)
    require(args.seq_length <= args.max_position_embeddings, "--seq-length", args.seq_length,
            f"must not exceed --max-position-embeddings ({args.max_position_embeddings})")
    require(args.kv_channels is not None or args.hidden_size % args.num_attention_heads == 0, "--num-attention-heads",
            args.num_attention_heads, f"must divide --hidden-size ({args.hidden_size}) unless --kv-channels is given")
    _validate_precision(args)
    require(not args.emulate_nccl or not args.p2p_host_staging and not torch.cuda.is_available(), "--emulate-nccl",
            True, "is for the CPU (gloo): on a GPU, run NCCL itself")
    require(not args.p2p_host_staging or torch.cuda.is_available(), "--p2p-host-staging", True,
            "needs a CUDA device (it stages GPU tensors through host memory)")
    if args.recompute_granularity == "full":
        require(args.recompute_method is not None, "--recompute-method", None,
                "--recompute-granularity full needs uniform or block")
        require(args.recompute_num_layers is not None, "--recompute-num-layers", None,
                "--recompute-granularity full needs it (megatron-core's rule)")
    _validate_recompute_modules(args)


def _validate_series(args) -> None:
    """The optional log series (observability/series.py). W&B: the package installed (Megatron-LM fails on
    its import, in the last rank alone, after setup), and a directory, --wandb-save-dir or Megatron-LM's
    default <--save>/wandb (without either, Megatron-LM fails on os.path.join(None, 'wandb'))."""
    require(args.tensorboard_log_interval > 0, "--tensorboard-log-interval", args.tensorboard_log_interval,
            "must be positive")
    if not args.wandb_project:
        return
    require(importlib.util.find_spec("wandb") is not None, "--wandb-project", args.wandb_project,
            "needs the wandb package, which is not installed: pip install wandb")
    require(bool(args.wandb_save_dir or args.save), "--wandb-save-dir", args.wandb_save_dir,
            "is needed without --save (W&B writes under <--save>/wandb by default)")
    path = args.wandb_save_dir or os.path.join(args.save, "wandb")
    require(_writable(path), "--wandb-save-dir", path, "must be a writable directory, or creatable in a writable one")


# megatron-core 0.19's choices for TransformerConfig.recompute_modules
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "gdn_norm_out")


def _validate_recompute_modules(args) -> None:
    """megatron-core's rules for --recompute-modules under --recompute-granularity selective (its
    TransformerConfig raises on them, naming no flag), on every device: moe_act stays in the list with
    --moe-grouped-gemm even where local layers leave it out (model/chunk.py's ``te_only_recompute``)."""
    if args.recompute_granularity != "selective":
        return
    rules = {"moe_act": (args.moe_grouped_gemm, "needs --moe-grouped-gemm (megatron-core's rule)"),
             "mla_up_proj": (args.multi_latent_attention, "needs --multi-latent-attention (megatron-core's rule)"),
             "shared_experts": (not (args.moe_shared_expert_overlap and args.moe_shared_expert_intermediate_size),
                                "cannot be combined with --moe-shared-expert-overlap (megatron-core's rule)"),
             "gdn_norm_out": (False, "recomputes the gated-delta-net attention variant's norm, which is not "
                                     "supported yet")}
    for module in args.recompute_modules or ():
        require(module in RECOMPUTE_MODULES, "--recompute-modules", module,
                f"is not one of megatron-core's modules ({', '.join(RECOMPUTE_MODULES)})")
        allowed, rule = rules.get(module, (True, ""))
        require(allowed, "--recompute-modules", module, rule)


def _validate_layout(args) -> None:
    """The schedule's options and rules, and the model stages it cuts --num-layers into (the run plan
    is built from these, after parsing: ``run_plan.make_run_plan``)."""
    pp, name = args.pipeline_model_parallel_size, resolved_schedule(args)
    args.pipeline_schedule = name
    check_options(name, given_options(args))
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
    request = schedule_request(args)
    stages = model_stages(args, request)
    if args.save and args.ckpt_format == "torch":  # legacy_save.py: Megatron-LM's per-rank files
        require(stages == pp, "--ckpt-format", "torch", f"--pipeline-schedule {name} runs {stages} model stages on "
                f"{pp} pipeline ranks; Megatron-LM's torch format holds one stage per rank (save torch_dist)")
        require(args.expert_model_parallel_size == 1, "--ckpt-format", "torch",
                "is not written with --expert-model-parallel-size > 1 (save torch_dist)")
    if args.balance_pipeline_layout:
        args.pipeline_model_parallel_layout = str(balanced_layout(args, stages, request))
    _check_mtp(args, stage_layout(args, stages), request)
    _check_overlap(args, request)
    if request is not None:
        _check_request(args, request)
        _check_split_backward(args, request)
        _check_recompute_split(args, request)
    if args.chimera_concat == "halving":
        require(args.micro_batch_size % 2 == 0, "--micro-batch-size", args.micro_batch_size,
                "must be even for --chimera-concat halving (it runs half-size micro-batches)")
    args.fresh_start = None
    if args.load and _first_launch(args):
        args.fresh_start, args.load = args.load, None


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
              f"or dualpipev with --pipeline-model-parallel-size > 1 (got {args.pipeline_schedule} at "
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
    if args.mtp_num_layers:
        needs("with --mtp-num-layers is not supported yet")


def _check_split_backward(args, request: ScheduleSpec) -> None:
    """A schedule with a split backward (I and W passes: asked with --split-backward, or DualPipe's own)
    runs Transformer Engine's layers with their weight gradients delayed to W (delay_wgrad_compute and
    backward_dw(), from the release ``delayed_wgrad_te`` names); with an older one, it is refused."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    wgrad = args.overlap_grad_reduce, args.gradient_accumulation_fusion
    if (not uses_transformer_engine(args.transformer_impl, device_type) or delays_weight_gradients(*wgrad)
            or request.overlap):
        return  # with --overlap-moe-expert-parallel-comm the schedule plan splits the backward itself
    asked = " --split-backward" if request.split_backward else ""
    require(not _splits_backward(request), "--transformer-impl", args.transformer_impl,
            f"Transformer Engine's fused linears compute the input and weight gradients together, which "
            f"--pipeline-schedule {request.schedule}{asked} separates: that needs Transformer Engine "
            f"{delayed_wgrad_te(*wgrad)} or later (delay_wgrad_compute under these flags; installed: "
            f"{transformer_engine_version()}); "
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
            f"{args.pipeline_schedule} schedule cannot send (its messages have one shape): put m with L, or run "
            "one of our schedules")


def _megatron_spellings(args) -> None:
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


def _validate_architecture(args) -> None:
    """After validate_args, which derives the position embedding, the FFN width and the kv channels as
    Megatron-LM does: query groups only with --group-query-attention (megatron-core's None otherwise)."""
    if not args.group_query_attention:
        args.num_query_groups = None
    else:
        groups, tp = args.num_query_groups, args.tensor_model_parallel_size
        require(groups is not None and groups > 0 and args.num_attention_heads % groups == 0, "--num-query-groups",
                groups, f"must divide --num-attention-heads ({args.num_attention_heads})")
        require(groups % tp == 0, "--num-query-groups", groups,
                f"must be a multiple of --tensor-model-parallel-size ({tp})")
    require(args.rope_type in (None, "rope") or args.multi_latent_attention, "--rope-type", args.rope_type,
            "applies to --multi-latent-attention; standard attention runs rope (Megatron-LM's rule)")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    require(not (args.multi_latent_attention and args.tensor_model_parallel_size > 1 and not args.sequence_parallel)
            or not uses_transformer_engine(args.transformer_impl, device_type), "--sequence-parallel", False,
            "is required with --multi-latent-attention and tensor parallelism in Transformer Engine's layers: "
            "without it megatron-core 0.19's duplicated key-value down projection keeps only each rank's own heads' "
            "share of the key's position gradient (megatron-core's local layers are corrected here)")
    require(not (args.multi_latent_attention and args.qk_layernorm and args.q_lora_rank is None)
            or uses_transformer_engine(args.transformer_impl, device_type), "--qk-layernorm", True,
            "with --multi-latent-attention and no --q-lora-rank normalises inside Transformer Engine's fused "
            "norm and query projection, which megatron-core 0.19's local layers lack: give --q-lora-rank, or "
            "run Transformer Engine on a GPU")
    _validate_recipe_layers(args, device_type)
    _context_parallel_attention(args, device_type)
    _validate_config_fields(args)
    if args.num_experts is not None:
        _validate_experts(args)


def _context_parallel_attention(args, device_type: str) -> None:
    """Which attention runs a sequence split over CP ranks (model/context_parallel.py): Transformer Engine's
    on a GPU, as megatron-core's; on the CPU megatron-core's local attention over all-gathered keys and
    values, for standard causal attention over whole sequences."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    te = uses_transformer_engine(args.transformer_impl, device_type)
    require(te or device_type == "cpu", "--context-parallel-size", cp,
            "needs Transformer Engine's attention on a GPU (megatron-core's local attention refuses CP > 1): "
            "install transformer-engine and run --transformer-impl transformer_engine")
    if te:
        return
    require(not args.multi_latent_attention, "--context-parallel-size", cp,
            "on the CPU runs standard attention only, not --multi-latent-attention")
    require(args.window_size is None, "--context-parallel-size", cp,
            "on the CPU runs full causal attention only, not --window-size")


def _validate_recipe_layers(args, device_type: str) -> None:
    """Llama 3.1's RoPE and gpt-oss's attention and MLP flags: Megatron-LM's rules, and what megatron-core's
    layers run (its local attention has no unlimited window side; it picks windowed layers by layer number)."""
    require(not (args.quick_geglu and args.swiglu), "--quick-geglu", True,
            "cannot be combined with --swiglu (Megatron-LM's rule)")
    factor = args.rotary_seq_len_interpolation_factor
    require(factor is None or factor > 0, "--rotary-seq-len-interpolation-factor", factor, "must be positive")
    window, freq = args.window_size, args.window_attn_skip_freq
    if window is None:
        return
    shown = ",".join(map(str, window))
    require(len(window) == 2, "--window-size", shown, "takes the window's left and right sizes, e.g. 128,0")
    require(min(window) >= 0 or uses_transformer_engine(args.transformer_impl, device_type), "--window-size", shown,
            "with a negative (unlimited) side runs in Transformer Engine's attention only: megatron-core 0.19's "
            "local attention then masks every position")
    require(not isinstance(freq, list) or len(freq) == args.num_layers, "--window-attn-skip-freq", freq,
            f"must give one entry per layer ({args.num_layers})")
    require(isinstance(freq, list) or freq is None or freq > 0, "--window-attn-skip-freq", freq, "must be positive")
    require(not (args.mtp_num_layers and freq is not None), "--mtp-num-layers", args.mtp_num_layers,
            "with --window-size and --window-attn-skip-freq is not supported yet: megatron-core numbers MTP "
            "layers 1, 2, ... apart from the model's, and a pipeline stage's slice of the window pattern numbers "
            "them as its own layers")


def _validate_config_fields(args) -> None:
    """Flags whose meaning is a field of megatron-core's config: the rules Megatron-LM's config builder and
    megatron-core check at construction (with a traceback), in one line before anything starts."""
    require(not (args.squared_relu and args.swiglu), "--squared-relu", True,
            "cannot be combined with --swiglu (Megatron-LM's rule)")
    require(not (args.squared_relu and args.bias_gelu_fusion), "--squared-relu", True,
            "needs --no-bias-gelu-fusion or --disable-bias-linear (megatron-core fuses the bias with gelu, swiglu "
            "and quick_geglu only)")
    for flag, given in (("--qk-l2-norm", args.qk_l2_norm), ("--attention-output-gate", args.attention_output_gate)):
        require(not (given and args.multi_latent_attention), flag, True,
                "is not supported with --multi-latent-attention (megatron-core's rule)")
    std = args.embedding_init_method_std
    require(std is None or std >= 0, "--embedding-init-method-std", std, "must not be negative")
    freq, layers = args.no_rope_freq, args.num_layers
    if freq is None:
        return
    require(len(freq) == layers if isinstance(freq, list) else freq > 0 and layers % freq == 0, "--no-rope-freq",
            freq, f"must give one entry per layer or a number that divides them ({layers}; megatron-core's rule)")
    require(not args.mtp_num_layers, "--mtp-num-layers", args.mtp_num_layers,
            "with --no-rope-freq is not supported yet: megatron-core numbers MTP layers 1, 2, ... apart from the "
            "model's, and a pipeline stage's slice of the pattern numbers them as its own layers")


def _validate_experts(args) -> None:
    """Mixture of experts: the layer pattern covers the model, and what is not supported yet says so."""
    freq = args.moe_layer_freq
    require(not isinstance(freq, list) or len(freq) == args.num_layers, "--moe-layer-freq", freq,
            f"must give one entry per layer ({args.num_layers})")
    require(not args.fp16, "--fp16", True, "with --num-experts is not supported yet (with the auxiliary losses "
            "loss-scaled as megatron-core scales them, one process and every pipelined layout still differ "
            "beyond fp16's bound): give --bf16")
    require(not args.add_bias_linear, "--disable-bias-linear", False,
            "is required with --num-experts: megatron-core 0.19's expert MLPs with biases fail in autograd (an "
            "in-place update of a view); Megatron-LM's MoE recipes set it")
    require(args.tensor_model_parallel_size == 1 or args.sequence_parallel, "--sequence-parallel", False,
            "is required with --num-experts and tensor parallelism (megatron-core's rule for MoE layers)")
    require(not (args.moe_shared_expert_overlap and args.moe_shared_expert_intermediate_size)
            or args.moe_token_dispatcher_type == "alltoall", "--moe-shared-expert-overlap", True,
            "needs --moe-token-dispatcher-type alltoall (megatron-core's rule)")
    require(args.moe_router_load_balancing_type != "sinkhorn" or not args.moe_aux_loss_coeff, "--moe-aux-loss-coeff",
            args.moe_aux_loss_coeff, "must be 0 with --moe-router-load-balancing-type sinkhorn (megatron-core's rule)")


def _require_documents(args, prefix: str) -> None:
    """Every part of --split that training reads (train; valid with --eval-iters) gets at least one
    document of ``prefix``, counted as megatron-core splits it."""
    documents = IndexedDataset(prefix).sequence_lengths.shape[0]
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))
    for name, bookends in zip(("train", "validation"), matrix[:2 if args.eval_iters else 1]):
        count = 0 if bookends is None else round(bookends[1] * documents) - round(bookends[0] * documents)
        require(count > 0, "--split", args.split, f"gives the {name} part 0 of the {documents} documents of "
                f"{prefix}; give it a larger share" + (" or set --eval-iters 0" if name == "validation" else ""))


def _training_length(args) -> None:
    """--train-iters, or Megatron-LM's --train-samples (then --train-iters is derived and the LR
    schedule counts samples, with the sample-based warmup and decay flags)."""
    require((args.train_iters is None) != (args.train_samples is None), "--train-iters", args.train_iters,
            "give exactly one of --train-iters and --train-samples")
    require(args.lr_warmup_fraction is None or 0 <= args.lr_warmup_fraction <= 1 and not args.lr_warmup_iters
            and not args.lr_warmup_samples, "--lr-warmup-fraction", args.lr_warmup_fraction,
            "must be in [0, 1], without --lr-warmup-iters or --lr-warmup-samples")
    unit = "samples" if args.train_samples else "iters"
    if args.train_samples is None:
        for flag, value in (("--lr-warmup-samples", args.lr_warmup_samples),
                            ("--lr-decay-samples", args.lr_decay_samples)):
            require(not value, flag, value, "goes with --train-samples; with --train-iters use the -iters flag")
    else:
        g = args.global_batch_size
        require(args.train_samples > 0 and args.train_samples % g == 0, "--train-samples", args.train_samples,
                f"must be a positive multiple of --global-batch-size ({g})")
        for flag, value in (("--lr-warmup-iters", args.lr_warmup_iters), ("--lr-decay-iters", args.lr_decay_iters)):
            require(not value, flag, value, "goes with --train-iters; with --train-samples use the -samples flag")
        args.train_iters = args.train_samples // g
    require(args.train_iters > 0, "--train-iters", args.train_iters, "must be positive")
    schedule = lr_schedule(args)  # megatron-core's scheduler asserts this without naming a flag
    require(schedule["lr_warmup_steps"] < schedule["lr_decay_steps"],
            "--lr-warmup-fraction" if args.lr_warmup_fraction is not None else f"--lr-warmup-{unit}",
            schedule["lr_warmup_steps"], f"must be below the decay length, {schedule['lr_decay_steps']}"
            f" (--lr-decay-{unit}, or else --train-{unit})")


def lr_schedule(args) -> dict:
    """megatron-core's OptimizerParamScheduler settings (the ones it checks on load), in iterations or,
    with --train-samples, in samples (``lr_increment`` per iteration)."""
    if args.train_samples:
        total, decay, warmup = args.train_samples, args.lr_decay_samples or args.train_samples, args.lr_warmup_samples
    else:
        total, decay, warmup = args.train_iters, args.lr_decay_iters or args.train_iters, args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": warmup, "lr_decay_steps": decay,
            "lr_decay_style": args.lr_decay_style, "start_wd": _or(args.start_weight_decay, args.weight_decay),
            "end_wd": _or(args.end_weight_decay, args.weight_decay), "wd_incr_steps": total,
            "wd_incr_style": args.weight_decay_incr_style}


def _or(value, default):
    return default if value is None else value


def lr_increment(args) -> int:
    return args.global_batch_size if args.train_samples else 1


_SCHEDULE_FLAG = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters/-samples/-fraction",
                  "lr_decay_steps": "--lr-decay-iters/-samples", "lr_decay_style": "--lr-decay-style",
                  "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
                  "wd_incr_steps": "--train-iters/-samples", "wd_incr_style": "--weight-decay-incr-style"}


def _check_schedule(args, saved: dict) -> None:
    """As Megatron-LM: resuming with another LR schedule is an error unless one of the two flags says
    which schedule wins."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    for key, value in lr_schedule(args).items():
        require(saved.get(key, value) == value, _SCHEDULE_FLAG[key], value,
                f"the checkpoint in {args.load} was trained with {key} {saved.get(key)}; pass "
                f"--override-opt_param-scheduler to use this run's schedule or --use-checkpoint-opt_param-scheduler "
                f"to keep the checkpoint's")


def _first_launch(args) -> bool:
    """``--save X --load X`` with nothing at X yet: every Megatron-LM script and Slurm requeue does this,
    so it starts from scratch, unless --exit-on-missing-checkpoint says a missing one is an error. A --load
    elsewhere with no checkpoint is always one (a typo must not train from scratch silently)."""
    same = args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
    return same and not args.exit_on_missing_checkpoint and not os.path.exists(os.path.join(args.load, LATEST))


def _writable(path: str) -> bool:
    """Without creating anything: an existing writable directory, or a missing one whose nearest
    existing ancestor is a writable directory."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return os.path.isdir(path) and os.access(path, os.W_OK)
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent) and os.access(parent, os.W_OK)


def _checkpoint_args(args) -> None:
    """--use-checkpoint-args, as Megatron-LM's parse_and_validate_args: before any check (so a setting taken
    that we refuse fails as if given), Megatron-LM's load_args_from_checkpoint takes the model's settings, and
    the tokenizer's unless --no-use-tokenizer-model-from-checkpoint-args, from the args the --load checkpoint
    saved, once our manifest vouches for the file they are read from. Without a checkpoint there yet (a first
    launch), it says so and the flags stay as given, as in Megatron-LM."""
    require(args.load is not None, "--use-checkpoint-args", True, "needs --load (Megatron-LM's rule)")
    if os.path.isfile(os.path.join(args.load, LATEST)):
        folder, fmt = find_checkpoint(args.load)
        check_sizes(folder, args.load)
        read_common(folder, fmt, args.load)  # checks the digests of what is unpickled
    load_args_from_checkpoint(args)


def _validate_checkpoint(args) -> None:
    """--load must hold a whole checkpoint of this model's shape (sizes and common state only)."""
    folder, fmt = find_checkpoint(args.load)
    check_sizes(folder, args.load)
    common = read_common(folder, fmt, args.load)
    check_shape(args, common, args.load)
    if args.verify_integrity:
        reason = unverifiable(folder, fmt)
        require(reason is None, "--verify-integrity", True, reason)
    loads_optimizer = not (args.finetune or args.no_load_optim)
    require(fmt != "torch" or not loads_optimizer, "--load", args.load,
            "is a legacy torch checkpoint, whose optimizer state is not converted: pass --no-load-optim or --finetune")
    require(fmt != "torch_dist" or not loads_optimizer or "optimizer" in common, "--load", args.load,
            "holds no optimizer state (a model saved alone?): pass --no-load-optim or --finetune")
    saved_optimizer = getattr(common.get("args"), "optimizer", args.optimizer)
    require(not loads_optimizer or saved_optimizer == args.optimizer, "--optimizer", args.optimizer,
            f"the checkpoint in {args.load} holds {saved_optimizer}'s optimizer state: pass --no-load-optim or "
            "--finetune to start this optimizer afresh")
    if loads_optimizer and "opt_param_scheduler" in common:
        _check_schedule(args, common["opt_param_scheduler"])


def _validate_data(args) -> None:
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"  # Megatron-LM's legacy default, which its validate_args also takes
    require(args.mock_data != bool(args.data_path), "--data-path", args.data_path,
            "give exactly one of --data-path and --mock-data")
    if args.data_path:
        prefixes = args.data_path[1::2] if len(args.data_path) > 1 else args.data_path
        if len(args.data_path) > 1:
            require(len(args.data_path) % 2 == 0, "--data-path", " ".join(args.data_path),
                    "a blend is pairs of WEIGHT PREFIX")
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                require(os.path.isfile(prefix + ext), "--data-path", prefix,
                        f"no such file {prefix + ext} (make it with scripts/preprocess_data.py)")
        try:
            splits = [float(x) for x in args.split.replace("/", ",").split(",")]
        except ValueError:
            splits = []
        require(0 < len(splits) <= 3 and splits[0] > 0, "--split", args.split, "train,valid,test with train > 0")
        for prefix in prefixes:
            _require_documents(args, prefix)
    if args.tokenizer_type is None:
        args.tokenizer_type = default_type(args.vocab_file, args.merge_file)
    check_tokenizer_arguments(TokenizerSpec.from_args(args), require)


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
