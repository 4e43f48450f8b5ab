"""The model whose stage times a run waits: one of the planner's named shapes (``--model``), or a user's own
from a file of Megatron-LM model flags as a launch script has them (``--model-flags FILE``).

The file is read by the trainer's own parser and rules (``megatron.chimera.arguments.model_namespace``), so
any model ``pretrain_gpt.py`` builds can be benchmarked with the FFN width, experts, MTP and padded
vocabulary Megatron-LM derives for it. Its parallel and batch sizes do not matter here: the benchmark
sets depth and micro-batches itself.
"""
from __future__ import annotations

import os

from chimera_schedules.tools.planner import MODELS, ModelShape

FLAGS_PROFILE = "h100-datasheet.json"  # a --model-flags model's default profile, in profiles/


def name_of(model: str, flags_file: str | None) -> str:
    """The name rows carry: the named model's, or the flags file's own name without its extension."""
    return os.path.splitext(os.path.basename(flags_file))[0] if flags_file else model


def shape_of(model: str, flags_file: str | None) -> ModelShape:
    if flags_file is None:
        return MODELS[model]
    from megatron.chimera.arguments import model_namespace  # here: the trainer's parser, for flag files only
    from megatron.chimera.config.balanced_layout import model_shape
    from megatron.chimera.plan import flags_of

    return model_shape(model_namespace(flags_of(flags_file)))
