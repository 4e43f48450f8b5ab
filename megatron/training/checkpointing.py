"""Checkpoints in Megatron's directory layout, readable by any schedule and pipeline layout.

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/manifest.json                    shape, schedule, layout, iteration, sha256 per file
    SAVE/iter_0000100/metadata.pt                      iteration, samples, LR scheduler, model shape
    SAVE/iter_0000100/mp_rank_TT_PPP/model_optim_rng.pt  weights + AdamW state (data-parallel rank 0)
    SAVE/iter_0000100/rng/rank_RRRRR.pt                per-rank RNG states

Weights and optimizer state are keyed by *global parameter name* (and saved once per logical tensor,
by pipeline 0's copy), not by chunk, so a Chimera checkpoint loads into 1F1B or into one process:
each rank takes the tensors of the chunks it holds. Tensor parallelism must match.

Writes are atomic: every rank writes into ``iter_X.tmp``; after a barrier rank 0 renames it to
``iter_X`` and then replaces the ``latest`` file. A crash mid-save leaves the previous checkpoint as
the latest one. Loads use ``torch.load(weights_only=True)``: a checkpoint file cannot run code; and
every file is checked against the manifest (sizes before any process starts, sha256 at load time), so a
truncated or corrupted file is named, never silently used.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import shutil

import torch
import torch.distributed as dist

from chimera_schedules import ScheduleConfigError

from .model import TIED_NAME

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
              "max_position_embeddings", "position_embedding_type", "untie_embeddings_and_output_weights",
              "disable_bias_linear", "tensor_model_parallel_size", "normalization", "swiglu", "num_query_groups",
              "kv_channels", "qk_layernorm", "add_qkv_bias")


class CheckpointError(ScheduleConfigError):
    """A checkpoint that cannot be used, named by the --load directory and the reason."""

    def __init__(self, root: str, rule: str):
        super().__init__("--load", root, rule)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _owned(trainer):
    """(global name, parameter) this rank saves: pipeline 0's copy of every tensor, on DP rank 0;
    the tied embedding once, from stage 0."""
    if trainer.rt.dp_rank != 0:
        return []
    last = trainer.rt.model_stages - 1
    out = []
    for (p, s), chunk in trainer.chunks.items():
        for param in chunk.parameters():
            if p == 0 and not (param.global_name == TIED_NAME and s == last and last > 0):
                out.append((param.global_name, param))
    return out


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(trainer, iteration: int, consumed_samples: int, fault_hook=None) -> str:
    """Collective. Returns the final directory."""
    args, rt = trainer.args, trainer.rt
    final = iteration_dir(args.save, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    owned = _owned(trainer)
    if owned:
        state = {id(p): s for p, s in trainer.optimizer.state.items()}
        shard = {"model": {name: p.detach().cpu() for name, p in owned},
                 "optimizer": {name: {k: (v.detach().cpu() if torch.is_tensor(v) else v)
                                      for k, v in state.get(id(p), {}).items()} for name, p in owned}}
        folder = os.path.join(tmp, f"mp_rank_{rt.tp_rank:02d}_{rt.worker:03d}")
        os.makedirs(folder, exist_ok=True)
        torch.save(shard, os.path.join(folder, "model_optim_rng.pt"))
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rt.rank:05d}.pt"))
    if fault_hook is not None:
        fault_hook()  # tests: die here, mid-save
    files = {}
    for path in [os.path.join(tmp, "rng", f"rank_{rt.rank:05d}.pt")] + (
            [os.path.join(tmp, f"mp_rank_{rt.tp_rank:02d}_{rt.worker:03d}", "model_optim_rng.pt")] if owned else []):
        files[os.path.relpath(path, tmp)] = _digest(path)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, files)
    if dist.get_rank() == 0:
        torch.save({"iteration": iteration, "consumed_samples": consumed_samples,
                    "scheduler": trainer.scheduler.state_dict(),
                    "shape": {k: getattr(args, k) for k in SHAPE_KEYS},
                    "layout": {"world": rt.world, "tp": rt.tp, "pp": rt.pp, "dp": rt.dp,
                               "schedule": args.pipeline_schedule}},
                   os.path.join(tmp, "metadata.pt"))
        manifest = {"iteration": iteration, "shape": {k: getattr(args, k) for k in SHAPE_KEYS},
                    "schedule": args.pipeline_schedule, "layout": {"world": rt.world, "tp": rt.tp, "pp": rt.pp, "dp": rt.dp},
                    "files": {k: v for per_rank in gathered for k, v in per_rank.items()}}
        manifest["files"]["metadata.pt"] = _digest(os.path.join(tmp, "metadata.pt"))
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest_tmp = os.path.join(args.save, LATEST + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(args.save, LATEST))
    dist.barrier()
    return final


def find_checkpoint(root: str) -> str:
    """The directory the latest file names; CheckpointError with the reason otherwise."""
    latest = os.path.join(root, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(root, f"no checkpoint there (no {LATEST})")
    with open(latest) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(root, f"{LATEST} does not hold an iteration number ({text!r})")
    folder = iteration_dir(root, int(text))
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        raise CheckpointError(root, f"{LATEST} names iteration {text}, but {folder} has no {MANIFEST}")
    return folder


def _digest(path: str) -> dict:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"bytes": os.path.getsize(path), "sha256": sha.hexdigest()}


def read_manifest(folder: str, root: str) -> dict:
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(root, f"{MANIFEST} in {folder} is unreadable ({e.__class__.__name__})") from None


def check_sizes(folder: str, root: str) -> None:
    """Cheap, before any process starts: every file the manifest lists is there, whole."""
    for rel, want in read_manifest(folder, root)["files"].items():
        path = os.path.join(folder, rel)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != want["bytes"]:
            have = "missing" if size is None else f"{size} of {want['bytes']} bytes"
            raise CheckpointError(root, f"{rel} in {folder} is truncated or missing ({have})")


def verified_load(path: str, folder: str, root: str, **kwargs):
    """torch.load(weights_only=True) of a file whose sha256 matches the manifest."""
    rel = os.path.relpath(path, folder)
    want = read_manifest(folder, root)["files"].get(rel)
    if want is None or _digest(path) != want:
        raise CheckpointError(root, f"{rel} in {folder} is corrupted (its sha256 does not match {MANIFEST})")
    return torch.load(path, weights_only=True, **kwargs)


def read_metadata(folder: str, root: str | None = None) -> dict:
    return verified_load(os.path.join(folder, "metadata.pt"), folder, root or os.path.dirname(folder))


def check_shape(args, metadata: dict, root: str) -> None:
    for key, value in metadata["shape"].items():
        if getattr(args, key) != value:
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(root, f"checkpoint has {flag}={value}, this run {getattr(args, key)}: "
                                        f"model shapes must match")


def load_checkpoint(trainer) -> tuple[int, int]:
    """Load weights, optimizer state, LR scheduler and (same layout only) RNG states; returns
    (iteration, consumed samples). Collective only in that every rank reads."""
    args, rt = trainer.args, trainer.rt
    folder = find_checkpoint(args.load)
    weights, optim, failure = {}, {}, None
    try:
        meta = read_metadata(folder, args.load)
        check_shape(args, meta, args.load)
        for path in sorted(glob.glob(os.path.join(folder, f"mp_rank_{rt.tp_rank:02d}_*", "model_optim_rng.pt"))):
            shard = verified_load(path, folder, args.load, mmap=True)
            weights.update(shard["model"])
            optim.update(shard["optimizer"])
    except CheckpointError as e:
        failure = e
    bad = torch.tensor([failure is not None], dtype=torch.int32, device=rt.device)
    rt.all_reduce(bad)  # every rank stops if any rank found a bad file
    if failure is not None:
        raise failure
    if bad.item():
        raise CheckpointError(args.load, f"another rank found a corrupted file in {folder}")
    with torch.no_grad():
        for chunk in trainer.models:
            for param in chunk.parameters():
                if param.global_name not in weights:
                    raise CheckpointError(args.load, f"{folder} has no {param.global_name}")
                param.copy_(weights[param.global_name])
                if optim.get(param.global_name):
                    # AdamW keeps its step count on the CPU; moments live with the parameter
                    trainer.optimizer.state[param] = {
                        k: (v.clone().to(param.device if v.dim() else "cpu") if torch.is_tensor(v) else v)
                        for k, v in optim[param.global_name].items()}
    trainer.scheduler.load_state_dict(meta["scheduler"])
    rng_file = os.path.join(folder, "rng", f"rank_{rt.rank:05d}.pt")
    same_layout = meta["layout"]["world"] == rt.world and meta["layout"]["pp"] == rt.pp
    if same_layout and os.path.isfile(rng_file):
        _restore_rng(verified_load(rng_file, folder, args.load))
    return meta["iteration"], meta["consumed_samples"]


def _restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
