"""--verify-integrity, as Megatron-LM means it: megatron-core's integrity manifest.

Megatron-LM passes the flag to megatron-core's ``dist_checkpointing.save``, which then writes
``integrity.json`` (the sha256 of every file of the torch_dist checkpoint), and to its ``load``, which
re-hashes every file against it first and refuses a checkpoint saved without one. Ours saves and loads
through the same functions with the same flag, so a checkpoint saved here with it verifies under
Megatron-LM and the other way round. Our own ``manifest.json`` (checkpointing.py) is written and checked
whatever the flag says; ``integrity.json`` is the one Megatron-LM reads. Megatron-LM allows the flag
with --ckpt-format torch_dist only (the legacy per-rank files have no manifest).
"""
from __future__ import annotations

import os

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.validation import INTEGRITY_FNAME, verify_integrity_manifest

from .format import CheckpointError


def unverifiable(folder: str, fmt: str) -> str | None:
    """Why the checkpoint in ``folder`` (of format ``fmt``) cannot be verified, before any process starts;
    None when it can."""
    if fmt != "torch_dist":
        return f"{folder} is a legacy torch checkpoint, which has no integrity manifest to verify"
    if not os.path.isfile(os.path.join(folder, INTEGRITY_FNAME)):
        return f"{folder} has no {INTEGRITY_FNAME}: it was not saved with --verify-integrity"
    return None


def verify(folder: str, root: str) -> None:
    """Collective: megatron-core re-hashes every file against ``integrity.json`` on rank 0 and every rank
    raises the same error; ours is its first line and the first file it names, one line."""
    try:
        verify_integrity_manifest(folder)
    except CheckpointingException as e:
        said = " ".join(line.strip() for line in str(e).splitlines()[:2])
        raise CheckpointError(root, f"--verify-integrity: {said}") from None
