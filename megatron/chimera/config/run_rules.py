"""The run's own flags: intervals, rates and paths, precision and loss scaling, the run-time switches,
recomputation, the optional log series, and Muon (megatron-core's rules for each, in one line naming the
flag before anything starts)."""
from __future__ import annotations

import importlib.util
import os

import torch
from megatron.core.optimizer.emerging_optimizers import get_supported_coefficient_types

from chimera_schedules.ir.errors import require

from .data_rules import check_data


def check_run(args) -> None:
    """Intervals, rates, paths, data, precision and the run-time switches."""
    for flag, value in (("--log-interval", args.log_interval), ("--eval-interval", args.eval_interval),
                        ("--save-interval", args.save_interval),
                        ("--recompute-num-layers", args.recompute_num_layers),
                        ("--distributed-timeout-minutes", args.distributed_timeout_minutes),
                        ("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by),
                        ("--max-consecutive-nan-iterations", args.max_consecutive_nan_iterations),
                        ("--exit-interval", args.exit_interval or 1),
                        ("--check-weight-hash-across-dp-replicas-interval",
                         args.check_weight_hash_across_dp_replicas_interval),
                        ("--exit-duration-in-mins", args.exit_duration_in_mins or 1)):
        require(value is None or value > 0, flag, value, "must be positive")
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
    legacy_optimizer = args.ckpt_format == "torch" and args.save and not args.no_save_optim
    require(not legacy_optimizer or not args.use_distributed_optimizer, "--ckpt-format", "torch",
            "with --use-distributed-optimizer would need Megatron-LM's distrib_optim.pt, laid out by its DDP's CUDA "
            "buffers, which is not written here: save torch_dist, or add --no-save-optim")
    require(not legacy_optimizer or args.optimizer == "adam", "--ckpt-format", "torch",
            f"holds Megatron-LM's AdamW state only, not --optimizer {args.optimizer}'s: save torch_dist, or add "
            "--no-save-optim")
    require(not args.verify_integrity or args.ckpt_format == "torch_dist", "--verify-integrity", True,
            "needs --ckpt-format torch_dist (Megatron-LM's rule: the torch format has no integrity manifest)")
    check_data(args)
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


def check_series(args) -> None:
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


def check_muon(args) -> None:
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
