"""What every checkpoint reader shares: the error that names --load, torch.load's allow-list for
the classes Megatron-LM's checkpoints pickle, and the digest of a file our manifest records."""
from __future__ import annotations

import argparse
import hashlib
import io
import os

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


def digest(path: str) -> dict:
    """A file's size and sha256, as manifest.json records them."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"bytes": os.path.getsize(path), "sha256": sha.hexdigest()}
