"""What validation asks of the layers above config: the tokenizer the flags name (data/), what Transformer
Engine runs on this machine (model/), and the checkpoint at --load (checkpoint/). ``parse_args``
(megatron/chimera/arguments.py) hands them in, so that config imports none of those layers and each sits
above it (tests/unit/test_trainer_layers.py); the rules that read their answers stay with the flags' others.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .data_spec import TokenizerSpec


class TransformerEngine(Protocol):
    """model/chunk.py's answers about Transformer Engine (the module itself is one)."""

    def uses_transformer_engine(self, transformer_impl: str, device_type: str) -> bool: ...

    def delays_weight_gradients(self, overlap_grad_reduce: bool, gradient_accumulation_fusion: bool) -> bool: ...

    def delayed_wgrad_te(self, overlap_grad_reduce: bool, gradient_accumulation_fusion: bool) -> str: ...

    def transformer_engine_version(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class SavedCheckpoint:
    """The checkpoint at --load, read and vouched for (its sizes and digests, its model shape against the
    run's): ``format``, torch_dist or Megatron-LM's legacy torch; ``common``, its common state (Megatron-LM's
    saved args, the LR scheduler's settings, the optimizer's when saved); ``unverifiable``, why
    --verify-integrity cannot check it (None: it can, or it was not asked)."""

    format: str
    common: dict
    unverifiable: str | None


@dataclass(frozen=True, kw_only=True)
class LayerProbes:
    """``build_tokenizer(spec, megatron_args)``: the tokenizer (data/tokenizer.py). ``transformer_engine``:
    see above. ``take_checkpoint_args(load, megatron_args)``: --use-checkpoint-args, Megatron-LM's
    load_args_from_checkpoint once the checkpoint vouches for the file it reads. ``read_checkpoint(load,
    megatron_args, verify_integrity)``: the checkpoint a resume loads."""

    build_tokenizer: Callable[[TokenizerSpec, argparse.Namespace], object]
    transformer_engine: TransformerEngine
    take_checkpoint_args: Callable[[str, argparse.Namespace], None]
    read_checkpoint: Callable[[str, argparse.Namespace, bool], SavedCheckpoint]
