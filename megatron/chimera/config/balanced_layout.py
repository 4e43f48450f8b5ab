"""--balance-pipeline-layout: the balancer's layout (chimera_schedules.tools.balancer) for the model the
flags describe, under the run's schedule (generated once: ``run_plan.generated``), depth, micro-batches
and hardware profile.

The trainer applies it as Megatron-LM's --pipeline-model-parallel-layout would be applied: the string is
stored there, so the startup line and the checkpoint's arguments read one layout, and the ranks agree
on it before iteration 1 (distributed/schedule_agreement.py).
"""
from __future__ import annotations

import os

from chimera_schedules import ConfigError, build
from chimera_schedules.ir.errors import require
from chimera_schedules.ir.layout import Layout
from chimera_schedules.tools.balancer import Sizes, balance, per_rank
from chimera_schedules.tools.planner import Experts, ModelShape, Precision, Profile

from .run_plan import generated
from .schedule_request import microbatches, resolved_schedule

FLAG = "--balance-pipeline-layout"
PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                        "profiles")
HAND_FLAGS = (("--pipeline-model-parallel-layout", "pipeline_model_parallel_layout"),
              ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
              ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
              ("--account-for-embedding-in-pipeline-split", "account_for_embedding_in_pipeline_split"),
              ("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split"))


def profile_path(name: str) -> str:
    """A JSON path as given, or a profile shipped in profiles/ by name."""
    return name if os.path.isfile(name) else os.path.join(PROFILES, name.removesuffix(".json") + ".json")


def model_shape(args) -> ModelShape:
    """The planner's shape of the model the flags build (FFN width as Megatron-LM derives it)."""
    h = args.hidden_size
    ffn = args.ffn_hidden_size or (int(8 * h / 3 / 64) * 64 if args.swiglu else 4 * h)
    experts = None
    if args.num_experts is not None:
        freq = args.moe_layer_freq
        pattern = list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(args.num_layers)]
        experts = Experts(args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size or ffn, sum(pattern),
                          args.moe_shared_expert_intermediate_size or 0)
    return ModelShape(args.num_layers, h, args.num_attention_heads, args.seq_length, args.padded_vocab_size, ffn,
                      args.swiglu, experts, mtp=args.mtp_num_layers or 0)


def balanced_layout(args, stages: int, request) -> Layout:
    """The balancer's pick for this run (our schedule as requested; megatron-core's 1F1B and
    interleaved as our generators order them)."""
    for flag, dest in HAND_FLAGS:
        require(not getattr(args, dest), FLAG, args.balance_pipeline_layout, f"cannot be combined with {flag}")
    profile = _profile(args.balance_pipeline_layout)
    pp, name = args.pipeline_model_parallel_size, resolved_schedule(args)
    if request is not None:
        schedule = generated(request)  # the run plan's, generated once
    elif name == "megatron-interleaved":
        schedule = build("interleaved", pp, microbatches(args), virtual_stages=stages // pp)
    else:
        schedule = build("1f1b", pp, microbatches(args))
    sizes = Sizes(args.micro_batch_size, args.data_parallel_size, args.expert_model_parallel_size,
                  Precision(args.bf16 or args.fp16, args.use_distributed_optimizer, muon=args.optimizer == "muon"),
                  args.context_parallel_size)
    picked = balance(model_shape(args), profile, schedule, sizes, per_rank(schedule))
    require(picked.seconds != float("inf"), FLAG, args.balance_pipeline_layout,
            f"no split of the layers fits {profile.name}'s {profile.memory / 2**30:.0f} GiB per device (the "
            f"least needs {picked.memory / 2**30:.0f} GiB)")
    return picked.layout


def _profile(name: str) -> Profile:
    """The profile by path or by name in profiles/; one line naming the flag if it cannot be read."""
    path = profile_path(name)
    known = sorted(os.listdir(PROFILES)) if os.path.isdir(PROFILES) else []
    require(os.path.isfile(path), FLAG, name, f"no such profile (a JSON file, or one of {', '.join(known)})")
    try:
        return Profile.load(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(FLAG, name, f"not a readable profile: {e}") from None
