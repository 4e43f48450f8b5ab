"""--verify-integrity, as Megatron-LM means it: megatron-core's integrity manifest.

With the flag, Megatron-LM has megatron-core's ``dist_checkpointing.save`` write ``integrity.json`` (the
sha256 of every file of the torch_dist checkpoint) and its ``load`` re-hash every file against it first,
refusing a checkpoint saved without one. Ours writes the same file, byte for byte, and a checkpoint saved
here with the flag verifies under Megatron-LM and the other way round; but megatron-core hashes every file
on rank 0 alone, at the save and again at the load, on top of our ``manifest.json`` (checkpointing.py),
whose digests every writer takes of its own files and every rank checks a share of at a load. So ours
writes integrity.json from those digests, and at a load holds it against manifest.json once the files
have been checked against that: no file is hashed twice. A checkpoint without our manifest (Megatron-LM's)
is verified by megatron-core, as Megatron-LM verifies it. Megatron-LM allows the flag with --ckpt-format
torch_dist only (the legacy per-rank files have no integrity manifest).
"""
from __future__ import annotations

import json
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


def integrity_text(digests: dict) -> str:
    """integrity.json as megatron-core's ``save_integrity_manifest`` writes it (the sha256 of every file at the
    folder's top level but itself, by name), from ``digests`` (manifest.json's records, by relative path)."""
    files = {name: d["sha256"] for name, d in sorted(digests.items()) if os.sep not in name and name != INTEGRITY_FNAME}
    return json.dumps({"algorithm": "sha256", "files": files}, indent=2)


def verify(folder: str, root: str, recorded: dict | None) -> None:
    """Collective: the checkpoint in ``folder`` against its ``integrity.json``. ``recorded``: manifest.json's
    records, which every file has just been checked against, or None without our manifest. With them, every
    file integrity.json lists must have the sha256 they record (nothing is hashed again); without them,
    megatron-core re-hashes every file on rank 0 and every rank raises the same error: ours is its first line
    and the first file it names, one line."""
    if recorded is None:
        try:
            verify_integrity_manifest(folder)
        except CheckpointingException as e:
            said = " ".join(line.strip() for line in str(e).splitlines()[:2])
            raise CheckpointError(root, f"--verify-integrity: {said}") from None
        return
    try:
        with open(os.path.join(folder, INTEGRITY_FNAME)) as f:
            listed = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(root, f"--verify-integrity: {INTEGRITY_FNAME} in {folder} is unreadable "
                                    f"({e.__class__.__name__})") from None
    for name, sha256 in sorted(listed.items()):
        if name not in recorded:
            raise CheckpointError(root, f"--verify-integrity: {INTEGRITY_FNAME} in {folder} lists {name}, "
                                        f"which manifest.json does not")
        if recorded[name]["sha256"] != sha256:
            raise CheckpointError(root, f"--verify-integrity: {name} in {folder}: hash mismatch with {INTEGRITY_FNAME} "
                                        f"(the file is the one manifest.json records)")
