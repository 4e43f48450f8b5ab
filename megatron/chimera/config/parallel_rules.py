"""The sizes every other rule divides by, and the parallel dimensions: TP, PP, CP and DP fitting the world,
the global batch in micro-batches, the expert groups tiling each stage's ranks, the router's top-k and the
distributed optimizer's instances. Megatron-LM's and megatron-core's rules (their assertions name no flag),
checked before its validate_args so that each names the flag."""
from __future__ import annotations

import importlib.util
import math

from chimera_schedules.ir.errors import require

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
            "micro_batch_size", "lr")


def check_sizes(args) -> None:
    """The sizes every other rule divides by: given, positive, and fitting the world; then the
    data-parallel size and the global batch (Megatron-LM's default: one micro-batch per data-parallel
    rank), which must split into whole micro-batches per pipeline replica (schedule_request.microbatches).
    Megatron-LM's validate_args derives the same two fields."""
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
    if args.decrease_batch_size_if_needed:  # megatron-core's calculator rounds the batch down to whole steps
        require(args.global_batch_size >= per_step, "--global-batch-size", args.global_batch_size,
                f"must be at least micro-batch size x data-parallel size = {per_step}")
        args.global_batch_size -= args.global_batch_size % per_step
    require(args.global_batch_size % per_step == 0, "--global-batch-size", args.global_batch_size,
            f"must be a multiple of micro-batch size x data-parallel size = {per_step}")


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


def check_expert_layout(args) -> None:
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


def check_optimizer_instances(args) -> None:
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
