"""Checkpoint integrity at the cost of each rank's own share: the writers' digests make the manifest (rank 0
hashes only the files it wrote), every rank checks a share of the files at a load and all raise the same
one-line error; --verify-integrity's integrity.json is megatron-core's, byte for byte, written from those
digests and held against the manifest at a load, so no file is hashed twice. A corrupted or missing file
fails the load in one line naming it, and a checkpoint saved without integrity.json, or in the legacy torch
format, is refused before anything starts. What Megatron-LM's files pickle loads under megatron-core's
allow-list."""
import argparse
import io
import json
import os
import pickle
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import validation
from megatron.core.dist_checkpointing.validation import (
    INTEGRITY_FNAME,
    save_integrity_manifest,
    verify_integrity_manifest,
)
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
from megatron.core.transformer.enums import AttnBackend

from megatron.chimera.checkpoint import checkpointing
from megatron.chimera.checkpoint.checkpointing import MANIFEST, _digests, _publish, _verified, share
from megatron.chimera.checkpoint.format import CheckpointError, digest
from megatron.chimera.checkpoint.integrity import integrity_text, unverifiable, verify

NAMES = ("__0_0.distcp", "__1_0.distcp", "__0_1.distcp", "__1_1.distcp", ".metadata", "metadata.json")


@pytest.fixture
def saved(tmp_path):
    """A folder as dist_checkpointing.save(verify_integrity=True) leaves it: its files, then the manifest."""
    for name in ("__0_0.distcp", ".metadata", "metadata.json"):
        (tmp_path / name).write_bytes(name.encode() * 100)
    save_integrity_manifest(str(tmp_path))
    return tmp_path


@pytest.fixture
def published(tmp_path):
    """A checkpoint we published: files of different sizes, our manifest and integrity.json."""
    tmp = tmp_path / "iter_0000001.tmp"
    tmp.mkdir()
    for i, name in enumerate(NAMES):
        (tmp / name).write_bytes(bytes([i]) * (1000 * (i + 1)))
    _publish(str(tmp), str(tmp_path / "iter_0000001"), str(tmp_path), 1, integrity=True)
    return tmp_path / "iter_0000001"


def test_an_intact_checkpoint_verifies(saved):
    assert set(json.loads((saved / INTEGRITY_FNAME).read_text())["files"]) == {"__0_0.distcp", ".metadata",
                                                                               "metadata.json"}
    assert unverifiable(str(saved), "torch_dist") is None, "an intact checkpoint with its manifest"
    verify(str(saved), "ROOT", None)


@pytest.mark.parametrize("damage, said", [(lambda f: f.write_bytes(b"x" * 1600), "__0_0.distcp: hash mismatch"),
                                          (lambda f: f.unlink(), "__0_0.distcp: file missing or unreadable")])
def test_without_our_manifest_megatron_core_names_a_corrupted_or_missing_file_in_one_line(saved, damage, said):
    damage(saved / "__0_0.distcp")
    with pytest.raises(CheckpointError) as failed:
        verify(str(saved), "ROOT", None)
    message = str(failed.value)
    assert "\n" not in message and said in message and "--verify-integrity" in message, message


def test_a_checkpoint_without_the_manifest_or_in_torch_format_is_unverifiable(saved):
    (saved / INTEGRITY_FNAME).unlink()
    assert "not saved with --verify-integrity" in unverifiable(str(saved), "torch_dist")
    assert "legacy torch checkpoint" in unverifiable(str(saved), "torch")


def test_our_integrity_json_is_megatron_cores_byte_for_byte(saved):
    theirs = (saved / INTEGRITY_FNAME).read_text()
    (saved / INTEGRITY_FNAME).unlink()
    (saved / "sub").mkdir()  # megatron-core lists the folder's top level only
    (saved / "sub" / "file").write_text("x")
    assert integrity_text(_digests(str(saved), {})) == theirs, "integrity.json differs from megatron-core's"


def test_publishing_takes_the_writers_digests_and_hashes_only_the_others(tmp_path, monkeypatch):
    """Rank 0 hashes the files no writer reported (the ones it wrote) and integrity.json, each once; megatron-core
    hashes nothing; the manifest records the writers' digests as given; megatron-core verifies integrity.json."""
    tmp = tmp_path / "iter_0000001.tmp"
    tmp.mkdir()
    for name in NAMES:
        (tmp / name).write_bytes(name.encode() * 10)
    given = {name: digest(str(tmp / name)) for name in NAMES[:4]}
    hashed, real = [], checkpointing.digest
    monkeypatch.setattr(checkpointing, "digest", lambda path: hashed.append(os.path.basename(path)) or real(path))
    monkeypatch.setattr(validation, "_compute_file_hash", lambda path: pytest.fail(f"megatron-core hashed {path}"))
    _publish(str(tmp), str(tmp_path / "iter_0000001"), str(tmp_path), 1, digests=given, integrity=True)
    assert sorted(hashed) == sorted([*NAMES[4:], INTEGRITY_FNAME]), f"rank 0 hashed {hashed}"
    files = json.loads((tmp_path / "iter_0000001" / MANIFEST).read_text())["files"]
    assert {name: files[name] for name in NAMES[:4]} == given, "the manifest does not hold the writers' digests"
    monkeypatch.undo()
    verify_integrity_manifest(str(tmp_path / "iter_0000001"))


def test_with_our_manifest_verify_holds_integrity_json_against_it_and_hashes_nothing(published, monkeypatch):
    files = json.loads((published / MANIFEST).read_text())["files"]
    monkeypatch.setattr(validation, "_compute_file_hash", lambda path: pytest.fail(f"megatron-core hashed {path}"))
    verify(str(published), "ROOT", files)
    listed = json.loads((published / INTEGRITY_FNAME).read_text())
    listed["files"]["__1_0.distcp"] = "0" * 64
    (published / INTEGRITY_FNAME).write_text(json.dumps(listed))
    with pytest.raises(CheckpointError) as failed:
        verify(str(published), "ROOT", files)
    message = str(failed.value)
    assert "\n" not in message and "__1_0.distcp" in message and "hash mismatch with integrity.json" in message, \
        message


def test_the_shares_split_the_bytes_evenly_and_cover_every_file_once():
    files = {f"f{i}": {"bytes": size} for i, size in enumerate([900, 500, 400, 300, 300, 100, 100, 50])}
    shares = [share(files, rank, 3) for rank in range(3)]
    assert sorted(sum(shares, [])) == sorted(files), f"files verified not exactly once: {shares}"
    loads = [sum(files[rel]["bytes"] for rel in mine) for mine in shares]
    assert max(loads) - min(loads) <= 100, f"bytes per rank: {loads}"


def _two_ranks(monkeypatch, hashed: dict):
    """torch.distributed as two ranks, each a thread, see it (rank, world size, all_gather_object), with the
    files each one hashes recorded in ``hashed``."""
    local, gathered, barrier = threading.local(), [None, None], threading.Barrier(2)

    def all_gather_object(out, obj):
        gathered[local.rank] = obj
        barrier.wait()
        out[:] = list(gathered)

    monkeypatch.setattr(dist, "get_rank", lambda: local.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    real = checkpointing.digest
    monkeypatch.setattr(checkpointing, "digest", lambda path: hashed[local.rank].append(os.path.basename(path))
                        or real(path))
    return local


def _verified_by_two_ranks(folder, monkeypatch) -> tuple[dict, dict]:
    """What each of two ranks hashed, and the error each raised, verifying ``folder``."""
    hashed, errors = {0: [], 1: []}, {}
    local = _two_ranks(monkeypatch, hashed)

    def rank(r):
        local.rank = r
        try:
            _verified(str(folder), "ROOT")
        except CheckpointError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return hashed, errors


def test_each_rank_hashes_its_own_share_of_the_files(published, monkeypatch):
    hashed, errors = _verified_by_two_ranks(published, monkeypatch)
    assert errors == {}, errors
    assert sorted(hashed[0] + hashed[1]) == sorted([*NAMES, INTEGRITY_FNAME]) and hashed[0] and hashed[1], \
        f"each file must be hashed once, by one of the two ranks: {hashed}"


@pytest.mark.parametrize("bad", [("__1_1.distcp",), ("metadata.json", "__0_1.distcp")])
def test_every_rank_raises_the_same_line_naming_the_first_bad_file(published, monkeypatch, bad):
    for name in bad:  # one byte flipped, same size
        data = bytearray((published / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (published / name).write_bytes(bytes(data))
    _, errors = _verified_by_two_ranks(published, monkeypatch)
    assert errors.get(0) == errors.get(1) and min(bad) in errors[0] and "\n" not in errors[0], errors
    assert "is corrupted (its sha256 does not match manifest.json)" in errors[0], errors


class Unlisted:
    """A class no allow-list names."""


def test_what_megatron_lms_files_pickle_loads_under_megatron_cores_allow_list(tmp_path):
    """Megatron-LM's args (its enums among them), numpy's RNG state of the legacy files, the rerun state machine's
    enums and a BytesIO load with torch.load(weights_only=True) and no allow-list of ours; anything else is refused."""
    path = tmp_path / "model_optim_rng.pt"
    args = argparse.Namespace(model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto)
    torch.save({"args": args, "rng_state": [{"np_rng_state": np.random.get_state()}], "extra": io.BytesIO(b"x"),
                "rerun_state_machine": {"mode": RerunMode.DISABLED, "state": RerunState.NOT_RUNNING_YET,
                                        "diagnostic": RerunDiagnostic.CORRECT_RESULT}}, path)
    assert torch.load(path, weights_only=True)["args"].model_type == ModelType.encoder_or_decoder
    torch.save({"not allowed": Unlisted()}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
