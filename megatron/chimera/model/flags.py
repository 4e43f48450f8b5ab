"""Model-architecture flags derived from megatron-core's ``TransformerConfig``, under Megatron-LM's names.

A flag is a config field's name with dashes (``num_query_groups`` -> ``--num-query-groups``) unless
Megatron-LM spells it otherwise (``RENAMED``); its type, choices and default come from the field, so
they follow the pinned megatron-core. Megatron-LM's flags that set several fields or GPTModel
arguments (``--swiglu``, ``--use-rotary-position-embeddings``, ...) are in ``GPTModel`` terms in
``model.py``; flags that change nothing here are accepted with the reason in their help; mixture-of-
experts flags fail with one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import typing

# The TransformerConfig fields a GPT recipe sets, with Megatron-LM's flag where it is not the field's.
ARCHITECTURE = ("ffn_hidden_size", "num_query_groups", "kv_channels", "normalization", "layernorm_epsilon",
                "layernorm_zero_centered_gamma", "qk_layernorm", "add_qkv_bias", "hidden_dropout",
                "attention_dropout", "init_method_std", "apply_residual_connection_post_layernorm",
                "rotary_interleaved", "softmax_scale", "attention_backend", "cross_entropy_loss_fusion",
                "cross_entropy_fusion_impl", "calculate_per_token_loss")
RENAMED = {"layernorm_epsilon": "--norm-epsilon", "layernorm_zero_centered_gamma": "--apply-layernorm-1p"}

# Megatron-LM flags that do nothing here, and why (accepted so recipes run unchanged).
NO_EFFECT = {
    "--use-mcore-models": "models are always megatron-core's",
    "--no-masked-softmax-fusion": "the CPU and local layer spec use no fused softmax",
    "--attention-softmax-in-fp32": "megatron-core computes the attention softmax in fp32 already",
    "--no-bias-gelu-fusion": "bias-activation fusion is off here",
    "--no-bias-dropout-fusion": "bias-dropout fusion is off here",
    "--no-gradient-accumulation-fusion": "gradient-accumulation fusion is off here",
    "--no-rope-fusion": "RoPE fusion is off here",
    "--use-flash-attn": "attention is megatron-core's (Transformer Engine picks its kernels on a GPU)",
    "--overlap-grad-reduce": "stage gradients are always reduced as soon as each copy is done",
    "--grad-reduce-in-bf16": "gradients accumulate and reduce in fp32 here, under --bf16 too",
    "--no-create-attention-mask-in-dataloader": "no attention mask is ever built: attention is causal",
}
# The same for flags that take a value.
NO_EFFECT_VALUED = {
    "--tiktoken-pattern": "applies to the TikTokenizer, not offered here",
    "--num-workers": "samples are read in the training process (no DataLoader workers)",
}
MOE = ("--num-experts", "--expert-model-parallel-size", "--moe-router-topk", "--moe-grouped-gemm",
       "--moe-aux-loss-coeff", "--moe-router-load-balancing-type", "--moe-token-dispatcher-type",
       "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-layer-freq")


def flag(field: str) -> str:
    return RENAMED.get(field, "--" + field.replace("_", "-"))


def add_architecture_flags(group) -> None:
    """One flag per ARCHITECTURE field, typed and defaulted by the field itself."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    for name in ARCHITECTURE:
        f = fields[name]
        kind, choices = _kind(f.type)
        help_text = f"TransformerConfig.{name} (default {f.default})"
        if kind is bool:
            group.add_argument(flag(name), dest=name, action="store_true", help=help_text)
        else:
            group.add_argument(flag(name), dest=name, type=kind, choices=choices, default=f.default, help=help_text)


def _kind(annotation) -> tuple[type, tuple | None]:
    """bool, int, float, str (with choices for a Literal) or an Enum (by member name), through Optional."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return (lambda name: annotation[name]), tuple(annotation)
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return str, args
    if typing.get_origin(annotation) is typing.Union:
        return _kind(next(a for a in args if a is not type(None)))
    return annotation, None


def add_compatibility_flags(parser) -> None:
    group = parser.add_argument_group("Megatron-LM flags that change nothing here (accepted for recipes)")
    for name, why in NO_EFFECT.items():
        group.add_argument(name, action="store_true", help=f"no effect: {why}")
    for name, why in NO_EFFECT_VALUED.items():
        group.add_argument(name, metavar="VALUE", help=f"no effect: {why}")
    moe = parser.add_argument_group("mixture of experts (not supported yet)")
    for name in MOE:
        moe.add_argument(name, action=_Unsupported, nargs="?", help=argparse.SUPPRESS)


class _Unsupported(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: mixture-of-experts models are not supported yet")
