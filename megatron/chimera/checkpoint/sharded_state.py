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

LAYERS = "decoder.layers."
NUMBERED = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(.*)$")
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state, saved as Megatron-LM names it


def _sharded_classes():
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    return ShardedTensor, ShardedObject, ShardedTensorFactory


def _placed(item, offset: int, total: int, pipeline: int | None):
    """One sharded item moved from the chunk's layer numbering to the whole model's, its replica id
    extended by the pipeline index (None: already extended, as the items a factory builds are)."""
    ShardedTensor, _, ShardedTensorFactory = _sharded_classes()
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


def model_state(trainer) -> dict:
    """``{"model0": ..., "model1": ...}``, one entry per chunk this rank holds, as Megatron-LM names
    the chunks of an interleaved model."""
    args, held = trainer.job.megatron_args, trainer.plan.layout
    out = {}
    for i, (pipeline, stage) in enumerate(trainer.held):
        chunk, first = trainer.chunks[(pipeline, stage)], held.first_layer(stage)
        out[f"model{i}"] = _map(chunk.sharded_state_dict(),
                                lambda x, first=first, pipeline=pipeline: _placed(x, first, args.num_layers, pipeline))
    return out


def _by_parameter(models: dict) -> dict:
    """id(parameter) -> its sharded item (tensor or factory) in the model state."""
    ShardedTensor, _, ShardedTensorFactory = _sharded_classes()
    found = {}
    _map(models, lambda x: found.setdefault(id(x.data), x) if isinstance(x, (ShardedTensor, ShardedTensorFactory))
         else None)
    return found


def optimizer_state(trainer, models: dict, loading: bool, main_weights: bool) -> dict:
    """AdamW's moments (and, ``main_weights``, the fp32 main weights of --fp16 and --bf16) under
    Megatron-LM's keys (``optimizer.state.exp_avg.<parameter key>``, ``optimizer.state.fp32_param.<key>``),
    sharded like their parameters; zeros to be filled when loading. Whole tensors either way: the
    distributed optimizer gathers its shards first (Megatron's fully reshardable format), so a
    checkpoint loads with or without it. The step count (one number for all parameters), whether
    main weights are there and the loss scale go to the common state. Collective when saving."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    sharded = _by_parameter(models)
    names = MOMENTS + (("fp32_param",) if main_weights else ())
    full = {} if loading else trainer.main.full_state(trainer.optimizer, names)
    state = {name: {} for name in names}
    for i, chunk in enumerate(trainer.models):
        for pname, param in chunk.named_parameters():
            kept = full.get(id(param), {})
            for name in names:
                value = kept.get(name)
                if value is None:
                    value = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                state[name][f"{i}.{pname}"] = make_sharded_optimizer_tensor(sharded[id(param)], value,
                                                                            f"optimizer.state.{name}")
    out = {"state": state, "step": trainer.optimizer_steps(), "fp32_param": main_weights}
    if trainer.scaler:
        out["grad_scaler"] = trainer.scaler.state_dict()
    return out


def restore_optimizer(trainer, loaded: dict, common: dict) -> None:
    """The moments, the fp32 main weights when the checkpoint has them (else they stay the loaded
    model weights), and the loss scale."""
    states = {}
    for i, chunk in enumerate(trainer.models):
        for pname, param in chunk.named_parameters():
            states[id(param)] = {name: loaded["state"][name][f"{i}.{pname}"].to(param.device)
                                 for name in loaded["state"]}
    trainer.main.load_full_state(trainer.optimizer, states, common["step"])
    if trainer.scaler and "grad_scaler" in common:
        trainer.scaler.load_state_dict(common["grad_scaler"])


def _rng_tensors() -> dict:
    """This rank's RNG states as tensors, so loading them unpickles nothing."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, words, gauss = random.getstate()
    out = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64),
           "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64)}
    out.update({f"tracker.{name}": s for name, s in get_cuda_rng_tracker().get_states().items()})
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def rng_state(rank: int, world: int) -> dict:
    ShardedTensor = _sharded_classes()[0]
    return {name: ShardedTensor.from_rank_offsets(f"rng_state.{name}", t.unsqueeze(0), (0, rank, world), replica_id=0)
            for name, t in _rng_tensors().items()}


def restore_rng(loaded: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = {name: t[0] for name, t in loaded.items()}
    torch.set_rng_state(states.pop("torch"))
    gauss = states.pop("python_gauss").item()
    random.setstate((3, tuple(int(w) for w in states.pop("python")), None if gauss != gauss else gauss))
    if "cuda" in states:
        torch.cuda.set_rng_state(states.pop("cuda"))
    get_cuda_rng_tracker().set_states({name[len("tracker."):]: s for name, s in states.items()})
