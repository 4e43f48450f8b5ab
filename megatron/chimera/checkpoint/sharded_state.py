"""What a rank contributes to a torch_dist checkpoint: megatron-core's sharded state dicts of its model
chunks, placed in the whole model, plus the optimizer moments and RNG states sharded the same way.

A chunk is a GPTModel of its stage's layers (the run plan's layout) built as if unpipelined, so
megatron-core numbers its layers from 0 and sizes the layer axis by their count. Shifting that axis to
the chunk's place in the whole model gives the keys and offsets megatron-core's own GPTModel writes
(``decoder.layers.*`` stacked over all L layers, Transformer Engine's names via the local spec's key
map), whatever the layout, so a checkpoint resumes under any other. Where megatron-core keys each
layer on its own (``decoder.layers.<n>.*``: a model mixing dense and mixture-of-experts layers), the
layer number is shifted instead. MTP layers keep megatron-core's ``mtp.layers.<k>.*`` keys, and the
embedding copy of a stage of MTP layers is tied to the first stage's, as megatron-core ties it. The
copies of a stage that Chimera's second pipeline holds are replicas: their replica id gains the
pipeline index, so only pipeline 0's copy is written, and every copy reads it back.
"""
from __future__ import annotations

import random
import re
from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

LAYERS = "decoder.layers."
NUMBERED = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(.*)$")
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state, saved as Megatron-LM names it
MOMENTUM = ("momentum_buffer",)  # Muon's (emerging-optimizers' name, which megatron-core saves)


def _placed(item, offset: int, total: int, pipeline: int | None):
    """One sharded item moved from the chunk's layer numbering to the whole model's, its replica id
    extended by the pipeline index (None: already extended, as the items a factory builds are)."""
    changes = {}
    if pipeline is not None:
        rid = item.replica_id if isinstance(item.replica_id, tuple) else (item.replica_id,)
        changes["replica_id"] = (*rid, pipeline)
    if isinstance(item, ShardedTensorFactory):
        build = item.build_fn
        return replace(item, **changes,
                       build_fn=lambda *a: _map(build(*a), lambda x: _placed(x, offset, total, None)))
    numbered = NUMBERED.match(item.key)
    if numbered:  # a layer keyed on its own (layers that differ: dense and MoE), renumbered in the model
        changes["key"] = f"{numbered.group(1)}{int(numbered.group(2)) + offset}.{numbered.group(3)}"
    elif LAYERS in item.key:  # also the optimizer moments of layer parameters
        changes["global_shape"] = (total, *item.global_shape[1:])
        changes["global_offset"] = (item.global_offset[0] + offset, *item.global_offset[1:])
        if isinstance(item, ShardedTensor):
            changes["axis_fragmentations"] = (total, *item.axis_fragmentations[1:])
    return replace(item, **changes)


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    return fn(tree)


def chunk_state(chunk, first_layer: int, num_layers: int, pipeline: int) -> dict:
    """A chunk's megatron-core sharded state, placed in the whole model of ``num_layers`` layers: its
    layers from ``first_layer`` on, its replica id extended by the index of the pipeline that holds it."""
    return _map(chunk.sharded_state_dict(), lambda x: _placed(x, first_layer, num_layers, pipeline))


def _by_parameter(models: dict) -> dict:
    """id(parameter) -> its sharded item (tensor or factory) in the model state."""
    found = {}
    _map(models, lambda x: found.setdefault(id(x.data), x) if isinstance(x, (ShardedTensor, ShardedTensorFactory))
         else None)
    return found


def optimizer_tensors(chunks: list, models: dict, full: dict, names_of) -> dict:
    """The optimizer's per-parameter states ``names_of(parameter)`` under Megatron-LM's keys
    (``optimizer.state.exp_avg.<parameter key>``), sharded like their parameters in ``models`` (the chunks'
    placed sharded states): ``full[id(parameter)][name]``, whole tensors, or zeros to be filled by a load.
    Whole either way: the distributed optimizer gathers its shards first (Megatron's fully reshardable
    format), so a checkpoint loads with or without it. Keyed ``"<chunk index>.<parameter name>"`` per name."""
    sharded = _by_parameter(models)
    state = {}
    for i, chunk in enumerate(chunks):
        for pname, param in chunk.named_parameters():
            kept = full.get(id(param), {})
            for name in names_of(param):
                value = kept.get(name)
                if value is None:
                    value = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                state.setdefault(name, {})[f"{i}.{pname}"] = make_sharded_optimizer_tensor(
                    sharded[id(param)], value, f"optimizer.state.{name}")
    return state


def loaded_by_parameter(chunks: list, loaded: dict) -> dict[int, dict[str, torch.Tensor]]:
    """What ``optimizer_tensors`` keyed, loaded: id(parameter) -> its states, on the parameter's device."""
    states = {}
    for i, chunk in enumerate(chunks):
        for pname, param in chunk.named_parameters():
            key = f"{i}.{pname}"
            states[id(param)] = {name: by_key[key].to(param.device) for name, by_key in loaded.items() if key in by_key}
    return states


def _rng_tensors() -> dict:
    """This rank's RNG states as tensors, so loading them unpickles nothing."""
    version, words, gauss = random.getstate()
    out = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64),
           "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64)}
    out.update({f"tracker.{name}": s for name, s in get_cuda_rng_tracker().get_states().items()})
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def rng_state(rank: int, world: int) -> dict:
    return {name: ShardedTensor.from_rank_offsets(f"rng_state.{name}", t.unsqueeze(0), (0, rank, world), replica_id=0)
            for name, t in _rng_tensors().items()}


def restore_rng(loaded: dict) -> None:
    states = {name: t[0] for name, t in loaded.items()}
    torch.set_rng_state(states.pop("torch"))
    gauss = states.pop("python_gauss").item()
    random.setstate((3, tuple(int(w) for w in states.pop("python")), None if gauss != gauss else gauss))
    if "cuda" in states:
        torch.cuda.set_rng_state(states.pop("cuda"))
    get_cuda_rng_tracker().set_states({name[len("tracker."):]: s for name, s in states.items()})
