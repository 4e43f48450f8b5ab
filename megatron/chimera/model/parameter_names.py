"""The whole model's parameter names, as one process holding every layer and expert names them (what the
initialisation draws from, the gradient reductions group by, and Megatron-LM's legacy checkpoints key), and
the tensor-parallel shard of a named parameter. A small module of its own, so that the optimizer and the
checkpoint readers name parameters as the model builder (chunk.py) does without importing the builder."""
from __future__ import annotations

import re

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
# Transformer Engine's grouped experts
GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
TIED_NAME = "embedding.word_embeddings.weight"


def global_name(name: str, layer_offset: int, tied: bool, first_expert: int = 0) -> str:
    """The parameter's name in the whole (unsplit) model: layers numbered in the model, and experts
    among all experts (``first_expert``: this expert-parallel rank's first)."""
    if tied and name == "output_layer.weight":
        return TIED_NAME
    name = LOCAL_EXPERT.sub(lambda m: f".experts.local_experts.{int(m.group(1)) + first_expert}.", name)
    name = GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + first_expert}", name)
    return LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


def is_gated(config: TransformerConfig, gname: str) -> bool:
    """Whether the parameter is a gated MLP's fc1 ([gate; up]): --swiglu or --quick-geglu, which Megatron-LM
    makes gated linear units."""
    return config.gated_linear_unit and gname.endswith("linear_fc1.weight")


def tp_shard(full: torch.Tensor, dim: int, tp: int, rank: int, gated: bool) -> torch.Tensor:
    """This rank's slice of a full tensor. A gated fc1 is [gate; up] in one process, and each
    tensor-parallel rank holds [its gate rows; its up rows]."""
    if dim < 0:
        return full
    if gated:
        return torch.cat([half.chunk(tp, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(tp, dim)[rank]
