"""Checkpoints in Megatron-LM's ``torch_dist`` format, through megatron-core's dist_checkpointing.

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/metadata.json, .metadata, __R_I.distcp   megatron-core's dist_checkpointing
        (megatron-core 0.19 keeps the common state, iteration, args, opt_param_scheduler, optimizer
        step and layout, inside .metadata; 0.16's separate common.pt is still read)
    SAVE/iter_0000100/manifest.json    ours: the size and sha256 of every file above
    SAVE/iter_0000100/integrity.json   megatron-core's, with --verify-integrity: the sha256 of each file

Tensors are keyed and sharded as megatron-core's GPTModel writes them (sharded_state.py), so a
checkpoint loads into any tensor-parallel size, pipeline depth and schedule, ours or megatron-core's,
and into a plain GPTModel; a GPTModel's checkpoint loads here. Megatron-LM's legacy per-rank ``torch``
files are read too (legacy.py), and written with --ckpt-format torch (legacy_save.py). What is saved
and loaded is a mapping of named states (states.py), placed where Megatron-LM's checkpoints keep them
(layout.py), and the data position; these functions see them, a CheckpointSpec and the process-group
runtime, never the trainer, and name no state.

What we write is atomic: every rank writes into ``iter_X.tmp``; rank 0 then writes the manifest,
renames the folder and replaces the ``latest`` file, so a crash mid-save leaves the previous
checkpoint the latest one. With --async-save the files are written in the background (async_saves.py)
and all of that happens at the save's finalisation, so the same holds while a save is in flight.
The manifest's digests are taken where the files are written, in parallel: each rank's writer hashes
the files it wrote (its ``.distcp`` files, or its legacy per-rank file), and rank 0 only the few small
files it writes itself (megatron-core's metadata); rank 0 gathers them. At load every file is checked
against the manifest (sizes before any process starts, sha256 before anything is unpickled), each rank
hashing a share of the files (about 1/N of the bytes), and every rank raises the same one-line error
when one is bad, so a truncated or corrupted file is named, never used, and no tampered file runs code.
A foreign checkpoint (no manifest) is loaded as it is.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from functools import partial

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.validation import (
    INTEGRITY_FNAME,
    StrictHandling,
    maybe_report_missing_and_unexpected_keys,
)
from megatron.training.training import preprocess_common_state_dict

from ..config.checkpoint_spec import CheckpointSpec
from .async_saves import WriteResults
from .format import CheckpointError, digest
from .integrity import integrity_text
from .integrity import verify as verify_integrity
from .layout import load_into, ordered, to_load, to_save
from .legacy import load_legacy
from .legacy import read_common as legacy_common
from .legacy_save import save_legacy
from .states import DataPosition, LegacyStates, Place, State, StateMismatch

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
DIST_METADATA = "metadata.json"  # what marks a dist_checkpointing folder
CHECKPOINT_VERSION = 3.0  # Megatron-LM's
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
              "max_position_embeddings", "position_embedding_type", "untie_embeddings_and_output_weights",
              "add_bias_linear", "normalization", "swiglu", "num_query_groups", "kv_channels",
              "qk_layernorm", "add_qkv_bias", "quick_geglu", "softmax_type")
SHAPE_FLAGS = {"add_bias_linear": "--disable-bias-linear (add_bias_linear)"}  # dests named otherwise


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


# --- where the checkpoint is, and whether it is whole --------------------------------------------

def find_checkpoint(root: str) -> tuple[str, str]:
    """(folder, format) of the checkpoint --load names: the one its ``latest`` file points to, or the
    folder itself when it is one (a bare dist_checkpointing.save or an ``iter_X`` folder)."""
    latest = os.path.join(root, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            text = f.read().strip()
        if not (text.isdigit() or text == "release"):
            raise CheckpointError(root, f"{LATEST} does not hold an iteration number ({text!r})")
        folder = os.path.join(root, "release") if text == "release" else iteration_dir(root, int(text))
        if checkpoint_format(folder) is None:
            raise CheckpointError(root, f"{LATEST} names iteration {text}, but {folder} holds no checkpoint")
        return folder, checkpoint_format(folder)
    if checkpoint_format(root) is not None:
        return root, checkpoint_format(root)
    raise CheckpointError(root, f"no checkpoint there (no {LATEST})")


def checkpoint_format(folder: str) -> str | None:
    if os.path.isfile(os.path.join(folder, DIST_METADATA)):
        return "torch_dist"
    if os.path.isdir(folder) and any(d.startswith("mp_rank_") for d in os.listdir(folder)):
        return "torch"
    return None


def _manifest(folder: str, root: str) -> dict | None:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(root, f"{MANIFEST} in {folder} is unreadable ({e.__class__.__name__})") from None


def check_sizes(folder: str, root: str) -> None:
    """Cheap, before any process starts: every file the manifest lists is there, whole."""
    for rel, want in (_manifest(folder, root) or {"files": {}})["files"].items():
        path = os.path.join(folder, rel)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != want["bytes"]:
            have = "missing" if size is None else f"{size} of {want['bytes']} bytes"
            raise CheckpointError(root, f"{rel} in {folder} is truncated or missing ({have})")


def _corrupted(folder: str, root: str, rel: str) -> CheckpointError:
    return CheckpointError(root, f"{rel} in {folder} is corrupted (its sha256 does not match {MANIFEST})")


def _first_bad(folder: str, files: dict, names) -> str | None:
    """The first of ``names`` (by name) whose size or sha256 is not what ``files`` records, or that is unreadable."""
    for rel in sorted(names):
        try:
            if digest(os.path.join(folder, rel)) != files[rel]:
                return rel
        except OSError:
            return rel
    return None


def check_digests(folder: str, root: str) -> None:
    """Every file the manifest lists, hashed here."""
    files = (_manifest(folder, root) or {"files": {}})["files"]
    bad = _first_bad(folder, files, files)
    if bad is not None:
        raise _corrupted(folder, root, bad)


def share(files: dict, rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` verifies: the largest first, each to the rank with the fewest bytes
    so far, so every rank hashes about 1/world of the bytes (every rank computes the same split)."""
    load, mine = [0] * world, []
    for rel in sorted(files, key=lambda r: (-files[r]["bytes"], r)):
        least = load.index(min(load))
        load[least] += files[rel]["bytes"]
        if least == rank:
            mine.append(rel)
    return mine


def _verified(folder: str, root: str) -> dict | None:
    """Collective: every file the manifest lists checked against it, each rank hashing its share; every rank
    raises the same error, naming the first bad file by name, if one is. Returns the manifest's files."""
    manifest = _manifest(folder, root)
    if manifest is None:
        return None
    files = manifest["files"]
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, _first_bad(folder, files, share(files, dist.get_rank(), dist.get_world_size())))
    bad = min((rel for rel in found if rel is not None), default=None)
    if bad is not None:
        raise _corrupted(folder, root, bad)
    return files


# Where dist_checkpointing keeps the non-tensor state: .metadata since megatron-core 0.19, common.pt before
COMMON_FILES = ("common.pt", ".metadata")


def read_common(folder: str, fmt: str, root: str, checked: bool = False) -> dict:
    """The checkpoint's non-tensor state (iteration, args, scheduler), without loading any tensor; the files
    that hold it checked against the manifest first, unless they just were (``checked``: at a load, after
    ``_verified``)."""
    if fmt == "torch":
        return legacy_common(folder, root)
    files = (_manifest(folder, root) or {"files": {}})["files"]
    holders = [name for name in COMMON_FILES if name in files]
    bad = None if checked else _first_bad(folder, files, holders)  # before anything in them is unpickled
    if bad is not None:
        raise _corrupted(folder, root, bad)
    try:
        with warnings.catch_warnings():
            # read before any process group exists (the argument checks): that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            return dist_checkpointing.load_common_state_dict(folder)
    except Exception as e:  # noqa: BLE001 -- any unreadable file is the checkpoint's fault, named
        where = " or ".join(holders) or "the common state"
        raise CheckpointError(root, f"{where} in {folder} is unreadable ({str(e).splitlines()[0][:200]})") from None


def _shape(namespace: argparse.Namespace, key: str):
    """A shape setting as it acts: without grouped-query attention every head is its own group, however
    a run stored --num-query-groups (ours None, Megatron-LM's its default 1)."""
    if key == "num_query_groups" and not getattr(namespace, "group_query_attention", False):
        return None
    return getattr(namespace, key)


def check_shape(megatron_args: argparse.Namespace, common: dict, root: str) -> None:
    """The model shape of this run's Megatron-LM namespace against the one the checkpoint's ``args`` saved."""
    saved = common.get("args")
    for key in SHAPE_KEYS:
        if saved is not None and hasattr(saved, key) and _shape(saved, key) != _shape(megatron_args, key):
            flag = SHAPE_FLAGS.get(key, "--" + key.replace("_", "-"))
            raise CheckpointError(root, f"checkpoint has {flag}={_shape(saved, key)}, this run "
                                        f"{_shape(megatron_args, key)}: model shapes must match")


# --- save ----------------------------------------------------------------------------------------

def _saved_args(megatron_args: argparse.Namespace, consumed_samples: int) -> argparse.Namespace:
    """The run's flags as Megatron-LM stores them, plain values only (so loading them runs no code)."""
    plain = (int, float, str, bool, type(None))
    kept = {k: v for k, v in vars(megatron_args).items()
            if isinstance(v, plain) or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))}
    kept.update(consumed_train_samples=consumed_samples, consumed_valid_samples=0)
    return argparse.Namespace(**kept)


def save_checkpoint(states: Mapping[str, State], position: DataPosition, spec: CheckpointSpec, rt,
                    megatron_args: argparse.Namespace, on_written: Callable[[], None] = lambda: None,
                    on_published: Callable[[str], None] = lambda _: None, saves: AsyncCallsQueue | None = None) -> str:
    """Collective: ``states`` (named as states.py places them) into ``spec.save``, as iteration ``position``'s
    iteration, with Megatron-LM's ``megatron_args`` written as its checkpoints hold them; ``rt`` gives this
    rank's place. ``on_written`` runs once every rank has written its part, before the checkpoint is
    published; ``on_published`` with the final directory, which it returns, once it is.

    With ``saves`` (--async-save: megatron-core's queue of asynchronous saves, async_saves.py) the files
    are written in the background: this returns once they are planned and handed to the writer, and the
    save is finalised (written, checked by every rank, published) by ``saves.maybe_finalize_async_calls``.
    A save still in flight is finalised before this one starts."""
    if saves is not None:
        saves.maybe_finalize_async_calls(blocking=True)
    final = iteration_dir(spec.save, position.iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    finish = partial(_finish, tmp, final, spec, position.iteration, on_written=on_written, on_published=on_published)
    if spec.format == "torch":  # Megatron-LM's legacy per-rank files, written at once
        parts = LegacyStates.of(states, _saved(states, spec))
        written = save_legacy(parts, rt, tmp, _common(position, megatron_args), megatron_args)
        finish(written=lambda: {os.path.relpath(path, tmp): digest(path) for path in written})
        return final
    results = filesystem_async._results_queue = WriteResults(os.path.join(tmp, f".write-results-{dist.get_rank()}"))
    request = _write_dist(states, position, spec, rt, megatron_args, tmp, asynchronous=saves is not None)
    if saves is None:
        finish(written=lambda: results.digests)
    else:
        request.add_finalize_fn(partial(finish, written=lambda: results.digests))
        saves.schedule_async_request(request)
    return final


def _saved(states: Mapping[str, State], spec: CheckpointSpec) -> list[str]:
    """The states a save writes, in order: all, less the optimizer's part (optimizer, LR scheduler, loss scale)
    with --no-save-optim, as Megatron-LM leaves it out."""
    return ordered(states, lambda place: spec.save_optimizer or place.part != "optimizer")


def _write_dist(states: Mapping[str, State], position: DataPosition, spec: CheckpointSpec, rt, megatron_args,
                tmp: str, asynchronous: bool):
    """Collective: every rank's part of a torch_dist checkpoint into ``tmp``, through megatron-core; the
    asynchronous request to schedule, with ``asynchronous``."""
    state = _megatron_layout(states, position, spec, rt, megatron_args)
    # Megatron-LM's own preprocessing for megatron-core's check that every rank's common state matches rank 0's
    # (the common state is written by rank 0 alone): it compares a copy of the args without ``rank`` and
    # ``local_rank``, which differ by design, so no rank warns "common state dict differs". What is saved is the
    # unchanged state, args included. --verify-integrity's integrity.json is written at publishing (_publish),
    # from the digests the writers took, not by megatron-core, which would hash every file again on rank 0.
    return dist_checkpointing.save(state, tmp, async_sharded_save=asynchronous, async_strategy="mcore",
                                   preprocess_common_before_consistancy_check=preprocess_common_state_dict)


def _finish(tmp: str, final: str, spec: CheckpointSpec, iteration: int, written: Callable[[], dict],
            on_written: Callable[[], None], on_published: Callable[[str], None]) -> None:
    """Collective, once every rank's files are written: publish the checkpoint, with the digests each rank
    took of the files it wrote (``written()``: by file, relative to ``tmp``), so rank 0 reads only the files it
    wrote itself."""
    on_written()
    digests = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(written(), digests, dst=0)
    if dist.get_rank() == 0:
        _publish(tmp, final, spec.save, iteration, spec.retain_interval, {k: v for d in digests for k, v in d.items()},
                 spec.verify_integrity)
    dist.barrier()
    on_published(final)


def _common(position: DataPosition, megatron_args) -> dict:
    """What every Megatron-LM checkpoint holds beside the states: the iteration, its version, the args (the
    samples consumed among them)."""
    return {"iteration": position.iteration, "checkpoint_version": CHECKPOINT_VERSION,
            "args": _saved_args(megatron_args, position.consumed_samples)}


def _megatron_layout(states: Mapping[str, State], position: DataPosition, spec: CheckpointSpec, rt,
                     megatron_args) -> dict:
    """The states a save writes (``_saved``) where Megatron-LM's checkpoints keep them, with its metadata and our
    layout."""
    layout = {"schedule": spec.schedule, "world": rt.world, "tp": rt.tp, "pp": rt.pp, "dp": rt.dp}
    return to_save(states, _saved(states, spec), {**_common(position, megatron_args), "layout": layout})


class _NotAsync(logging.Filter):
    """megatron-core 0.19 writes every torch_dist save through its own asynchronous writer (a synchronous one
    runs it at once) and then warns on every rank that "MCore's async save is deprecated" in favour of
    nvidia-resiliency-ext's, which writes the same files: not an action for the user, so dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "async save is deprecated" not in record.getMessage()


logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").addFilter(_NotAsync())


def _publish(tmp: str, final: str, root: str, iteration: int, retain_interval: int | None = None,
             digests: dict | None = None, integrity: bool = False) -> None:
    """Rank 0: manifest (after megatron-core's integrity.json, with ``integrity``), then the rename, then the
    latest file, each made durable before the next. The manifests take the ``digests`` given (by file,
    relative to ``tmp``) and compute the others (the files rank 0 wrote). With --save-retain-interval, as
    Megatron-LM: the checkpoint the latest file named before goes, unless its iteration is a multiple of the
    interval."""
    files = _digests(tmp, digests or {})
    if integrity:
        _write_durably(os.path.join(tmp, INTEGRITY_FNAME), integrity_text(files))
        files[INTEGRITY_FNAME] = digest(os.path.join(tmp, INTEGRITY_FNAME))
    _write_durably(os.path.join(tmp, MANIFEST), json.dumps({"iteration": iteration, "files": files}, indent=1))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    previous = _latest_iteration(root)
    _write_durably(os.path.join(root, LATEST + ".tmp"), str(iteration))
    os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
    if retain_interval and previous not in (None, iteration) and previous % retain_interval:
        shutil.rmtree(iteration_dir(root, previous), ignore_errors=True)


def _digests(tmp: str, given: dict) -> dict:
    """Every file in ``tmp``: its digest as ``given`` (by file, relative to ``tmp``), or computed here."""
    files = {}
    for folder, _, names in os.walk(tmp):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), tmp)
            files[rel] = given.get(rel) or digest(os.path.join(folder, name))
    return files


def _latest_iteration(root: str) -> int | None:
    """The iteration the latest file names, if it names one."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _write_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# --- load ----------------------------------------------------------------------------------------

def load_checkpoint(states: Mapping[str, State], position: DataPosition, spec: CheckpointSpec, rt) -> None:
    """Collective: ``spec.load`` into ``states`` (named as states.py places them; ``rt`` gives this rank's
    place) and ``position``: the weights; unless --finetune / --no-load-optim / --no-load-rng say otherwise,
    the optimizer, loss scale and LR scheduler and (same layout only) the RNG states; the data position, 0
    with --finetune. Every file is verified first (``_verified``), and nothing is loaded if one is bad."""
    folder, fmt = find_checkpoint(spec.load)
    files = _verified(folder, spec.load)
    if fmt == "torch":
        common = legacy_common(folder, spec.load)
        load_legacy(LegacyStates.of(states, ordered(states, _loaded(spec, common, rt))), rt, folder, spec.load)
    else:
        if spec.verify_integrity:
            verify_integrity(folder, spec.load, files)
        common = _load_dist(states, spec, rt, folder)
    position.load_state_dict({"iteration": 0, "consumed_samples": 0} if spec.finetune else _position(common))


def _position(common: dict) -> dict:
    """The data position a checkpoint records: its iteration, and the samples consumed where its args say."""
    position = {"iteration": common.get("iteration", 0)}
    saved = common.get("args")
    if hasattr(saved, "consumed_train_samples"):
        position["consumed_samples"] = saved.consumed_train_samples
    return position


def _same_layout(common: dict, rt) -> bool:
    """Whether the checkpoint was saved by as many ranks, tensor- and pipeline-parallel alike (its ``layout``, ours;
    else its Megatron-LM args, all a legacy file records)."""
    args = common.get("args")
    layout = common.get("layout") or {"world": getattr(args, "world_size", None),
                                      "tp": getattr(args, "tensor_model_parallel_size", None),
                                      "pp": getattr(args, "pipeline_model_parallel_size", None)}
    return (layout.get("world"), layout.get("tp"), layout.get("pp")) == (rt.world, rt.tp, rt.pp)


def _loaded(spec: CheckpointSpec, common: dict, rt) -> Callable[[Place], bool]:
    """Which parts a load restores, as Megatron-LM's flags say: the optimizer's unless --no-load-optim or
    --finetune; the RNG states unless --no-load-rng or --finetune, and only into the layout they were saved in."""
    parts = {None: True, "optimizer": spec.load_optimizer, "rng": spec.load_rng and _same_layout(common, rt)}
    return lambda place: parts[place.part]


def _load_dist(states: Mapping[str, State], spec: CheckpointSpec, rt, folder: str) -> dict:
    """Every state the checkpoint fills, in one dist_checkpointing.load; returns its common state."""
    common = read_common(folder, "torch_dist", spec.load, checked=True)
    names = ordered(states, _loaded(spec, common, rt))
    request, objects = to_load(states, names, common)
    try:
        loaded = _load_strictly(request, folder, spec.strictness, objects)
    except Exception as e:  # noqa: BLE001 -- missing keys, wrong shapes: named, never a traceback per rank
        raise CheckpointError(spec.load, f"{folder} does not fit this model: {str(e).splitlines()[0][:300]}") from None
    try:
        load_into(states, names, loaded)
    except StateMismatch as e:
        raise CheckpointError(spec.load, str(e)) from None
    return common


def _load_strictly(request: dict, folder: str, strictness: str, skipped: set[str]) -> dict:
    """dist_checkpointing.load under --dist-ckpt-strictness, as Megatron-LM's loader passes it: what to do with
    keys the request and the checkpoint do not share (raise, log, ignore). The two that also look for keys of the
    checkpoint nobody requested (log_all, raise_all) do not count the ``skipped`` ones, which this loader leaves
    out on purpose (layout.to_load) and Megatron-LM requests: megatron-core returns the mismatches
    (return_all), and they are raised or logged as the flag says, in megatron-core's words."""
    if strictness not in (StrictHandling.LOG_ALL.value, StrictHandling.RAISE_ALL.value):
        return dist_checkpointing.load(request, folder, strict=strictness)
    loaded, missing, unexpected = dist_checkpointing.load(request, folder, strict=StrictHandling.RETURN_ALL)
    maybe_report_missing_and_unexpected_keys(missing - skipped, unexpected,
                                             raise_error=strictness == StrictHandling.RAISE_ALL.value)
    return loaded
