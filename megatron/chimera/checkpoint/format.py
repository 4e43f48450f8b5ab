"""What every checkpoint reader shares: the error that names --load, and the digest of a file our manifest
records. torch.load's allow-list for the classes Megatron-LM's checkpoints pickle besides tensors (its args
Namespace, megatron-core's enums, numpy's RNG state in the legacy files) is megatron-core's own
(megatron.core.safe_globals, registered with torch when megatron.core is imported), so every
``torch.load(weights_only=True)`` here accepts what Megatron-LM writes and runs no code."""
from __future__ import annotations

import hashlib
import os

from chimera_schedules import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used, named by the --load directory and the reason."""

    def __init__(self, root: str, rule: str):
        super().__init__("--load", root, rule)


def digest(path: str) -> dict:
    """A file's size and sha256, as manifest.json records them."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"bytes": os.path.getsize(path), "sha256": sha.hexdigest()}
