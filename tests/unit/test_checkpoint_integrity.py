"""--verify-integrity reads megatron-core's integrity manifest (integrity.json): a corrupted or missing
file fails the load in one line naming it, and a checkpoint saved without the manifest, or in the legacy
torch format, is refused before anything starts."""
import json

import pytest
from megatron.core.dist_checkpointing.validation import INTEGRITY_FNAME, save_integrity_manifest

from megatron.chimera.checkpoint.format import CheckpointError
from megatron.chimera.checkpoint.integrity import unverifiable, verify


@pytest.fixture
def saved(tmp_path):
    """A folder as dist_checkpointing.save(verify_integrity=True) leaves it: its files, then the manifest."""
    for name in ("__0_0.distcp", ".metadata", "metadata.json"):
        (tmp_path / name).write_bytes(name.encode() * 100)
    save_integrity_manifest(str(tmp_path))
    return tmp_path


def test_an_intact_checkpoint_verifies(saved):
    assert set(json.loads((saved / INTEGRITY_FNAME).read_text())["files"]) == {"__0_0.distcp", ".metadata",
                                                                               "metadata.json"}
    assert unverifiable(str(saved), "torch_dist") is None, "an intact checkpoint with its manifest"
    verify(str(saved), "ROOT")


@pytest.mark.parametrize("damage, said", [(lambda f: f.write_bytes(b"x" * 1600), "__0_0.distcp: hash mismatch"),
                                          (lambda f: f.unlink(), "__0_0.distcp: file missing or unreadable")])
def test_a_corrupted_or_missing_file_is_named_in_one_line(saved, damage, said):
    damage(saved / "__0_0.distcp")
    with pytest.raises(CheckpointError) as failed:
        verify(str(saved), "ROOT")
    message = str(failed.value)
    assert "\n" not in message and said in message and "--verify-integrity" in message, message


def test_a_checkpoint_without_the_manifest_or_in_torch_format_is_unverifiable(saved):
    (saved / INTEGRITY_FNAME).unlink()
    assert "not saved with --verify-integrity" in unverifiable(str(saved), "torch_dist")
    assert "legacy torch checkpoint" in unverifiable(str(saved), "torch")
