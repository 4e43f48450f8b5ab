"""The parallel dimensions (TP, PP, DP, EP, ...) and the backend: what the distributed code
(distributed/) reads of the flags, read once. The groups' rank lists depend on the run plan's placement
as well, and on the world the launcher started: distributed/process_groups.py derives them."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes as ``parse_args`` validated them (``dp`` derived there from the world size; ``etp``
    defaulted to TP there). ``backend``: --distributed-backend, None for Megatron-LM's default (nccl
    where there is a GPU). ``num_experts``, ``moe_dispatcher`` and ``moe_global_reduction`` (a z-loss or
    a global auxiliary loss, reduced over the tensor-data-and-context-parallel group) say which of
    megatron-core's MoE groups the run uses; ``tied_embeddings`` whether the output layer shares the
    word embedding (its copies form the embedding group). ``gloo_groups``: not --disable-gloo-process-groups,
    whether megatron-core creates its gloo process groups beside the others. ``optimizer_instances``:
    --num-distributed-optimizer-instances, the parts each replica group's optimizer shards split into;
    ``tp_pp_dp_mapping``: --use-tp-pp-dp-mapping, megatron-core's other rank order (rank_order.py);
    ``hierarchical_cp``: --hierarchical-context-parallel-sizes, the CP sub-groups of TE's a2a+p2p."""

    world: int
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    etp: int
    sequence_parallel: bool
    backend: str | None
    timeout_minutes: float
    p2p_host_staging: bool
    emulate_nccl: bool
    num_experts: int | None
    moe_dispatcher: str | None
    moe_global_reduction: bool
    tied_embeddings: bool
    gloo_groups: bool
    optimizer_instances: int = 1
    tp_pp_dp_mapping: bool = False
    hierarchical_cp: tuple[int, ...] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelDims:
        balancing = args.moe_router_load_balancing_type
        balancing = [balancing] if isinstance(balancing, str) else balancing or []
        return cls(
            world=args.world_size, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
            dp=args.data_parallel_size, cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
            etp=args.expert_tensor_parallel_size, sequence_parallel=args.sequence_parallel,
            backend=args.distributed_backend, timeout_minutes=args.distributed_timeout_minutes,
            p2p_host_staging=args.p2p_host_staging, emulate_nccl=args.emulate_nccl, num_experts=args.num_experts,
            moe_dispatcher=args.moe_token_dispatcher_type,
            moe_global_reduction=bool(args.moe_z_loss_coeff) or "global_aux_loss" in balancing,
            tied_embeddings=not args.untie_embeddings_and_output_weights, gloo_groups=args.use_gloo_process_groups,
            optimizer_instances=args.num_distributed_optimizer_instances,
            tp_pp_dp_mapping=args.use_tp_pp_dp_mapping,
            hierarchical_cp=tuple(args.hierarchical_context_parallel_sizes or ()) or None)

    @property
    def expert_groups(self) -> bool:
        """megatron-core marks expert parameters ``allreduce=False`` (reduced over expert groups) exactly
        when experts are parallel or split over a tensor-parallel size of their own."""
        return self.num_experts is not None and (self.ep > 1 or self.etp != self.tp)
