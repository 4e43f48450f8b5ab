"""The model: megatron-core's TransformerConfig (Megatron-LM's core_transformer_config_from_args) and what
GPTModel takes beside it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """The model: megatron-core's TransformerConfig (Megatron-LM's core_transformer_config_from_args) and what
GPTModel takes beside it."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSpec:
        return cls()
