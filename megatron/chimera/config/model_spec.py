"""The model: megatron-core's TransformerConfig, built by Megatron-LM's core_transformer_config_from_args, and what
GPTModel takes beside it.

The config is Megatron-LM's for the whole model, built once from the validated namespace by Megatron-LM's own
function (``MLATransformerConfig`` with --multi-latent-attention, as that function picks it). Three fields are
set apart, because megatron-core checks them at construction for what runs here and Megatron-LM on a GPU,
and the fields of the flags that have no effect here (config/flag_classes.py) stay at megatron-core's defaults
(``NO_EFFECT``):

- ``apply_rope_fusion`` and ``moe_permute_fusion`` (``KERNEL_CHECKED``): megatron-core refuses them where
  Transformer Engine's fused RoPE or permutation kernels are not installed (the CPU). The config is built with
  them off and given Megatron-LM's values after; each chunk's config keeps on only the fusions its device runs
  (model/chunk.py's ``fusion_fields``), and megatron-core checks those.
- ``overlap_moe_expert_parallel_comm``: megatron-core's rules for it belong to its combined 1F1B (bf16, virtual
  stages); ours runs schedule plans in our executor (config/schedule_rules.py's ``_check_overlap``), so the field
  stays off in the config and the flag is kept here.

Model chunks derive their configs from this one, replacing only what is their own (model/chunk.py's
``transformer_config``).
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.argument_utils import core_transformer_config_from_args

# --config-logger-dir (megatron-core would write its configs there); --test-mode (a collective inside attention's
# forward), --defer-embedding-wgrad-compute (its output layer would keep the weight gradient for megatron-core's
# schedules to compute) and --overlap-p2p-communication-warmup-flush, whose reasons flag_classes gives
NO_EFFECT = {"config_logger_dir": "", "test_mode": False, "defer_embedding_wgrad_compute": False,
             "wgrad_deferral_limit": 0,
             # megatron-core refuses it beside the batched p2p every chunk runs (model/chunk.py's BATCHED_P2P)
             "overlap_p2p_comm_warmup_flush": False}
# fusions megatron-core checks for their kernels at construction (see the module docstring)
KERNEL_CHECKED = ("apply_rope_fusion", "moe_permute_fusion")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """megatron-core's config of the whole model, and GPTModel's other arguments as Megatron-LM's GPT builder
    (gpt_config_from_args) passes them: the padded vocabulary, the positions and RoPE's settings (Llama 3.1's
    frequency scaling, position interpolation), whether the output layer shares the embedding's weight."""

    config: TransformerConfig
    vocab_size: int
    max_sequence_length: int
    position_embedding_type: str
    rotary_percent: float
    rotary_base: int
    rope_scaling: bool
    rope_scaling_factor: float
    seq_len_interpolation_factor: float | None
    share_embeddings_and_output_weights: bool
    seed: int  # every parameter is drawn from a generator seeded with it and the parameter's name
    enable_experimental: bool  # megatron-core's process-wide switch, set before a chunk is built
    overlap_moe_expert_parallel_comm: bool  # our executor runs schedule plans (see above)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSpec:
        config = core_transformer_config_from_args(_for_megatron_core(args))
        for field in KERNEL_CHECKED:  # as Megatron-LM's function copies them; see above
            setattr(config, field, getattr(args, field))
        return cls(config=config, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                   position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                   rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
                   rope_scaling_factor=args.rope_scaling_factor,
                   seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   seed=args.seed, enable_experimental=args.enable_experimental,
                   overlap_moe_expert_parallel_comm=args.overlap_moe_expert_parallel_comm)


def _for_megatron_core(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of the namespace for Megatron-LM's function, so that nothing writes to the validated one
    (megatron-core's config appends to lists it is given: "moe" to recompute_modules with
    --moe-layer-recompute), less the fields the module docstring sets apart."""
    values = {name: copy.copy(value) if isinstance(value, list) else value for name, value in vars(args).items()}
    return argparse.Namespace(**{**values, **NO_EFFECT, **dict.fromkeys(KERNEL_CHECKED, False),
                                 "overlap_moe_expert_parallel_comm": False})
