"""Megatron-LM's legacy ``--ckpt-format torch`` checkpoints, read.

Megatron-LM wrote one ``model_optim_rng.pt`` per (tensor, pipeline) rank, in ``mp_rank_TT`` or
``mp_rank_TT_PPP``: a plain state dict of that stage, its layers numbered from 0. We rebuild every
full tensor (tensor-parallel shards joined, layers renumbered into the whole model, Transformer
Engine's fused-norm names mapped to the local spec's) and copy this rank's slice, so any layout and
schedule reads them. Files are opened with ``torch.load(weights_only=True)`` and megatron-core's allow-list
of what Megatron-LM's files pickle (format.py). The optimizer state is not converted: Megatron-LM keyed it by its
own parameter order, so these checkpoints load with --finetune or --no-load-optim.
"""
from __future__ import annotations

import os
import pickle
import re

import torch

from ..model.parameter_names import LAYER, TIED_NAME, is_gated, tp_shard
from .format import CheckpointError

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
        if m and os.path.isfile(os.path.join(folder, name, "model_optim_rng.pt")):
            ranks[(int(m.group(2) or 0), int(m.group(1)))] = os.path.join(folder, name, "model_optim_rng.pt")
    by_pp = {}
    for (pp, _), path in sorted(ranks.items()):
        by_pp.setdefault(pp, []).append(path)
    return by_pp


def _load(path: str, root: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first_line = str(e).splitlines()[0][:200]
        raise CheckpointError(root, f"{path} holds objects we do not unpickle ({first_line})") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(root, f"{path} is unreadable ({str(e).splitlines()[0][:200]})") from None


def read_common(folder: str, root: str) -> dict:
    state = _load(_files(folder)[0][0], root)
    return {k: state[k] for k in ("iteration", "args", "opt_param_scheduler", "checkpoint_version") if k in state}


def _global_name(name: str, offset: int) -> str:
    for te, local in TE_NAMES.items():
        if name.endswith(te):
            name = name[: -len(te)] + local
    return LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _shards(folder: str, root: str) -> dict[str, list[torch.Tensor]]:
    """global name -> its tensor-parallel shards, over every pipeline rank's files."""
    shards, offset = {}, 0
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
                shards.setdefault(_global_name(name, offset), []).append(tensor)
        offset += len(layers)
    return shards


def _joined(parts: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    if dim < 0 or len(parts) == 1:
        return parts[0]
    if gated:  # each shard is [its gate rows; its up rows]
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([torch.cat([h[i] for h in halves], dim) for i in (0, 1)], dim)
    return torch.cat(parts, dim)


def load_legacy(chunks: list, tp: int, tp_rank: int, folder: str, root: str) -> dict:
    """Copy every parameter's slice of this tensor-parallel rank (``tp_rank`` of ``tp``) from a legacy
    checkpoint into ``chunks``; returns its common state."""
    shards = _shards(folder, root)
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
    return read_common(folder, root)
