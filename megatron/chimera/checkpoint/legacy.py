"""Megatron-LM's legacy ``--ckpt-format torch`` checkpoints, read.

Megatron-LM wrote one ``model_optim_rng.pt`` per (tensor, pipeline) rank, in ``mp_rank_TT`` or
``mp_rank_TT_PPP``: a plain state dict of that stage, its layers numbered from 0. We rebuild every
full tensor (tensor-parallel shards joined, layers renumbered into the whole model, Transformer
Engine's fused-norm names mapped to the local spec's) and copy this rank's slice, so any layout and
schedule reads the weights. The optimizer state (legacy_optimizer.py: megatron-core's optimizer over a stage,
keyed by its parameter groups' order) loads into the stages and tensor-parallel size it was saved with, under
any schedule that holds one stage per pipeline rank: each held chunk reads the file of the stage whose
first layer and parameters it has (else a CheckpointError says to pass --no-load-optim); the loss scale
and LR scheduler load from any file, the RNG states from this rank's own, in the same layout only. Files are
opened with ``torch.load(weights_only=True, mmap=True)`` (a tensor is read when it is used) and megatron-core's
allow-list of what Megatron-LM's files pickle (format.py).
"""
from __future__ import annotations

import os
import pickle
import random
import re

import numpy as np
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from ..model.parameter_names import LAYER, TIED_NAME, is_gated, tp_shard
from .format import CheckpointError
from .legacy_optimizer import loaded_state, megatron_groups
from .legacy_save import FILE
from .states import LegacyStates

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def _files(folder: str) -> dict[int, list[str]]:
    """pipeline rank -> the files of its tensor-parallel ranks, in order."""
    ranks = {}
    for name in os.listdir(folder):
        m = RANK_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, FILE)):
            ranks[(int(m.group(2) or 0), int(m.group(1)))] = os.path.join(folder, name, FILE)
    by_pp = {}
    for (pp, _), path in sorted(ranks.items()):
        by_pp.setdefault(pp, []).append(path)
    return by_pp


def _load(path: str, root: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first_line = str(e).splitlines()[0][:200]
        raise CheckpointError(root, f"{path} holds objects we do not unpickle ({first_line})") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(root, f"{path} is unreadable ({str(e).splitlines()[0][:200]})") from None


def read_common(folder: str, root: str) -> dict:
    """The non-tensor state of the first file; ``optimizer`` (empty: its tensors are not read here) when the
    files hold the optimizer state."""
    state = _load(_files(folder)[0][0], root)
    common = {k: state[k] for k in ("iteration", "args", "opt_param_scheduler", "checkpoint_version") if k in state}
    return {**common, "optimizer": {}} if "optimizer" in state else common


def _global_name(name: str, offset: int) -> str:
    for te, local in TE_NAMES.items():
        if name.endswith(te):
            name = name[: -len(te)] + local
    return LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _shards(folder: str, root: str) -> tuple[dict[str, list[torch.Tensor]], list[int]]:
    """global name -> its tensor-parallel shards, over every pipeline rank's files; and the first layer of each
    pipeline rank's stage in the whole model."""
    shards, firsts = {}, [0]
    for _, paths in sorted(_files(folder).items()):
        layers = set()
        for path in paths:
            state = _load(path, root)
            if "model" not in state:
                raise CheckpointError(root, f"{path} has no 'model' (an interleaved legacy checkpoint: not read)")
            for name, tensor in state["model"].items():
                if name.endswith("_extra_state") or not torch.is_tensor(tensor):
                    continue
                if m := LAYER.match(name):
                    layers.add(int(m.group(1)))
                shards.setdefault(_global_name(name, firsts[-1]), []).append(tensor)
        firsts.append(firsts[-1] + len(layers))
    return shards, firsts[:-1]


def _joined(parts: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    if dim < 0 or len(parts) == 1:
        return parts[0]
    if gated:  # each shard is [its gate rows; its up rows]
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([torch.cat([h[i] for h in halves], dim) for i in (0, 1)], dim)
    return torch.cat(parts, dim)


def _load_weights(chunks: list, tp: int, tp_rank: int, shards: dict, folder: str, root: str) -> None:
    """Copy every parameter's slice of this tensor-parallel rank (``tp_rank`` of ``tp``) from the checkpoint's
    ``shards`` into ``chunks``."""
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                name = param.global_name
                parts = shards.get(name) or (shards.get("output_layer.weight") if name == TIED_NAME else None)
                if parts is None:
                    raise CheckpointError(root, f"{folder} has no {name}")
                dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
                gated = is_gated(chunk.config, name)
                param.copy_(tp_shard(_joined(parts, dim, gated), dim, tp, tp_rank, gated))


def _tensors(state_dict: dict) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in state_dict.items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _stage_file(chunk, first: int, firsts: list[int], tp_rank: int, folder: str, root: str) -> dict:
    """The file of the stage ``chunk`` (its first layer ``first``) is, at this tensor-parallel rank: the pipeline
    rank whose stage starts there and has its parameters, names and shapes."""
    files, own = _files(folder), _tensors(chunk.state_dict())
    for pp, start in enumerate(firsts):
        if start == first and tp_rank < len(files[pp]):
            state = _load(files[pp][tp_rank], root)
            if _tensors(state["model"]) == own:
                return state
    raise CheckpointError(root, f"{folder} was saved with another pipeline layout, tensor-parallel size or layer "
                                "spec, whose optimizer state this run's stages cannot take: pass --no-load-optim")


def _load_optimizer(optimizer, model, tp_rank: int, firsts: list[int], saved_args, folder: str, root: str) -> None:
    """The optimizer state of every held chunk, from its stage's file, read by megatron-core's optimizer over
    the chunk (legacy_optimizer.py) under Megatron-LM's config of the checkpoint's ``saved_args``. Collective."""
    config, groups = megatron_groups(model.chunks, saved_args)
    whole, steps = {}, set()
    for (chunk, _, first), chunk_groups in zip(model.placed, groups):
        saved = _stage_file(chunk, first, firsts, tp_rank, folder, root)
        if "optimizer" not in saved:
            raise CheckpointError(root, f"{folder} holds no optimizer state: pass --no-load-optim or --finetune")
        states, step = loaded_state(chunk_groups, config, saved["optimizer"], optimizer.main.half)
        whole.update(states)
        steps.add(step)
    assert len(steps) == 1, f"the stages' files in {folder} hold different optimizer steps {sorted(steps)}"
    optimizer.load_whole_state(whole, steps.pop())


def _restore_rng(saved: dict) -> None:
    """This process's generators from Megatron-LM's ``rng_state`` entry (a CUDA state only where it has one)."""
    random.setstate(saved["random_rng_state"])
    np.random.set_state(saved["np_rng_state"])
    torch.set_rng_state(saved["torch_rng_state"])
    if saved["cuda_rng_state"].numel() and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(saved["rng_tracker_states"])


def load_legacy(parts: LegacyStates, rt, folder: str, root: str) -> None:
    """The states ``parts`` keeps from a legacy checkpoint, as the module's docstring says; ``rt`` gives this
    rank's place. Collective with the optimizer."""
    model = parts.model
    shards, firsts = _shards(folder, root)
    _load_weights(model.chunks, rt.tp, rt.tp_rank, shards, folder, root)
    model.weights_loaded()
    files = _files(folder)
    own = _load(files[rt.worker][rt.tp_rank] if parts.rng else files[0][0], root)
    if parts.optimizer is not None:
        _load_optimizer(parts.optimizer, model, rt.tp_rank, firsts, own.get("args"), folder, root)
    chained = own.get("optimizer")
    first = chained[0] if isinstance(chained, list) else chained or {}  # the loss scale: the same in each
    if parts.scaler is not None and "grad_scaler" in first:
        parts.scaler.load_state_dict(first["grad_scaler"])
    if parts.scheduler is not None and "opt_param_scheduler" in own:
        parts.scheduler.load_state_dict(own["opt_param_scheduler"])
    if parts.rng:
        _restore_rng(own["rng_state"][0])  # Megatron-LM's, without --data-parallel-random-init
