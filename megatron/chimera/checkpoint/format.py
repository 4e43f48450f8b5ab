"""What every checkpoint reader shares: the error that names --load, and torch.load's allow-list for
the classes Megatron-LM's checkpoints pickle."""
from __future__ import annotations

import argparse
import io

import numpy as np
import torch
from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
from megatron.core.transformer.enums import AttnBackend, ModelType
from numpy._core.multiarray import _reconstruct

from chimera_schedules import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used, named by the --load directory and the reason."""

    def __init__(self, root: str, rule: str):
        super().__init__("--load", root, rule)


def safe_globals():
    """The classes Megatron-LM's checkpoints pickle besides tensors, allowed to torch.load's
    weights_only unpickler (which runs no code); numpy's array for the legacy files' ``np_rng_state``."""
    return torch.serialization.safe_globals([argparse.Namespace, io.BytesIO, AttnBackend, ModelType,
                                             RerunDiagnostic, RerunMode, RerunState, _reconstruct, np.ndarray,
                                             np.dtype, np.dtypes.UInt32DType])
