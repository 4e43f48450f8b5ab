"""megatron-core 0.19's output-discarding activation checkpoint without Transformer Engine.

``CheckpointWithoutOutput`` (what --recompute-modules layernorm recomputes the norms with) takes ``fp8=False``
for "no fp8" but tests ``fp8 is not None``, so it always takes its fp8 branch, which calls Transformer Engine's
FP8GlobalStateManager: a NameError where Transformer Engine is not installed (the CPU, or a GPU without it).
Without Transformer Engine there is no fp8; ``apply`` makes the checkpoint say so. With it installed, nothing
changes (the branch then finds fp8 off, as megatron-core intends).
"""
from __future__ import annotations

import functools

from megatron.core.tensor_parallel import random


def apply() -> None:
    """Idempotent. Call before running megatron-core's layers."""
    checkpoint = random.CheckpointWithoutOutput
    if random.HAVE_TE or getattr(checkpoint, "fp8_off_without_te", False):
        return
    init = checkpoint.__init__

    @functools.wraps(init)  # its __wrapped__: megatron-core's own, which tests/unit/test_recipe_flags_loop.py probes
    def without_fp8(self, fp8=False):
        init(self, fp8)
        self.fp8 = False

    checkpoint.__init__ = without_fp8
    checkpoint.fp8_off_without_te = True
