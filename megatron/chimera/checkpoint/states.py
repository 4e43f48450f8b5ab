"""The named states a checkpoint holds, each an object that saves and loads itself, as torchtitan's
CheckpointManager takes them: ``state_dict``/``load_state_dict`` (torch's ``Stateful``), or, for tensors
sharded over ranks, megatron-core's ``sharded_state_dict`` with ``load_state_dict`` of what it filled.
``Trainer.states()`` names the trainer's; ``PLACES`` says where Megatron-LM's checkpoints keep each and
which come first; checkpointing.py saves and loads them in that layout without naming any, never seeing
the trainer:

    "model"         ModelChunks                -> model0, model1, ...  (the whole model's sharded keys)
    "optimizer"     OptimizerState             -> optimizer            (moments or momentum, fp32 main weights, step)
    "grad_scaler"   LossScaler (--fp16 only)   -> optimizer.grad_scaler
    "lr_scheduler"  OptimizerParamScheduler    -> opt_param_scheduler
    "rng"           RNGState                   -> rng_state            (sharded by rank)

How far the data was read (DataPosition) is the checkpoint's position rather than one of them: it names the
``iter_X`` folder, and Megatron-LM keeps it as ``iteration`` and in ``args`` (consumed_train_samples).
The classes here give the protocol to what lacks it: the held chunks with the main weights that shadow
them, AdamW with those main weights, the process's random generators, and how far the data was read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .sharded_state import (
    MOMENTS,
    MOMENTUM,
    chunk_state,
    loaded_by_parameter,
    optimizer_tensors,
    restore_rng,
    rng_state,
)


class ShardedStateful(Protocol):
    """megatron-core's protocol for state sharded over ranks: ``sharded_state_dict`` gives the sharded
    tensors to write, or to fill at a load; ``load_state_dict`` takes them filled. Its arguments: the sharded
    states of the states its place comes ``after``, and, at a load, ``metadata``: what the checkpoint holds
    at its place besides tensors (megatron-core's models and optimizers take a ``metadata`` too)."""

    def sharded_state_dict(self, *after: dict, metadata: dict | None = None) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


State = Stateful | ShardedStateful


@dataclass(frozen=True)
class Place:
    """Where Megatron-LM's checkpoints keep a named state, and what saving and loading it needs.

    ``key``: its path in the checkpoint ("a.b": nested; "": its keys at the top level, as the model's
    ``model0``, ``model1``, ..., which is why it is handed the whole checkpoint at a load). ``part``: the
    flags that leave it out, as Megatron-LM's: "optimizer" (--no-save-optim, --no-load-optim, --finetune),
    "rng" (--no-load-rng, --finetune, and a load into another layout, where a rank's generators are not the
    same rank's), None (none). ``after``: the states saved and loaded before it (their sharded states
    are its sharded state's arguments). Megatron-LM's legacy per-rank files (--ckpt-format torch) hold the same
    parts in their own form (legacy_save.py)."""

    key: str
    part: str | None = None
    after: tuple[str, ...] = ()


PLACES = {
    "model": Place(""),
    # its tensors are sharded like the model's; the fp32 main weights it loads replace those the model's load
    # copied into the main weights (ModelChunks.weights_loaded)
    "optimizer": Place("optimizer", "optimizer", after=("model",)),
    "grad_scaler": Place("optimizer.grad_scaler", "optimizer", after=("optimizer",)),  # inside the optimizer's
    "lr_scheduler": Place("opt_param_scheduler", "optimizer"),
    "rng": Place("rng_state", "rng"),
}


class StateMismatch(Exception):
    """A state the checkpoint cannot fill, and why (checkpointing.py names the --load directory)."""


class ModelChunks:
    """The model chunks this rank holds, ``model<i>`` in placement order, each placed in the whole model of
    ``num_layers`` layers (sharded_state.py), with the main weights that shadow them (``main``: precision.py's
    or the distributed optimizer's). A save reads the weights once the last step's pending gathers have
    finished (--overlap-param-gather); a load copies them into the main weights (--fp16, --bf16), which
    the optimizer's state may then replace."""

    def __init__(self, placed: list[tuple[torch.nn.Module, int, int]], num_layers: int, main):
        self.placed, self.num_layers, self.main = placed, num_layers, main  # (chunk, pipeline, first layer)

    @classmethod
    def of(cls, chunks: dict, held: list[tuple[int, int]], layout, main) -> ModelChunks:
        """``chunks[(pipeline, stage)]`` of the ``held`` keys, placed by the run plan's ``layout``."""
        return cls([(chunks[key], key[0], layout.first_layer(key[1])) for key in held], layout.num_layers, main)

    @property
    def chunks(self) -> list[torch.nn.Module]:
        return [chunk for chunk, _, _ in self.placed]

    def sharded_state_dict(self, metadata: dict | None = None) -> dict:
        """The chunks' sharded states (``metadata``, the checkpoint's at a load, changes no key)."""
        self.main.flush()
        return {f"model{i}": chunk_state(chunk, first, self.num_layers, pipeline)
                for i, (chunk, pipeline, first) in enumerate(self.placed)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Every tensor of ``model<i>`` into chunk i (``_extra_state`` objects, left unloaded, excepted)."""
        for i, chunk in enumerate(self.chunks):
            state = {k: v for k, v in state_dict[f"model{i}"].items() if torch.is_tensor(v)}
            missing, _ = chunk.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing:
                raise StateMismatch(f"the checkpoint has no {missing[0]}")
        self.weights_loaded()

    def weights_loaded(self) -> None:
        """After the model's weights were loaded, without their fp32 main copies: the main weights take them."""
        self.main.copy_from_model()


class OptimizerState:
    """AdamW (or Muon and AdamW) and the main weights it steps (``main``), as Megatron-LM's optimizer state:
    the moments (Muon's momentum for the parameters ``muon_steps`` names; None: AdamW steps all) and, in
    half precision, the fp32 main weights, sharded like the parameters of ``chunks`` (ModelChunks' order);
    the step count (one for all parameters) and whether main weights are there."""

    def __init__(self, optimizer: torch.optim.Optimizer, main, chunks: list[torch.nn.Module], muon_steps=None):
        self.optimizer, self.main, self.chunks, self.muon_steps = optimizer, main, chunks, muon_steps

    def sharded_state_dict(self, model_sharded_state_dict: dict, metadata: dict | None = None) -> dict:
        """megatron-core's optimizer protocol, over the model's sharded state; at a load (``metadata``: what the
        checkpoint holds of the optimizer besides tensors), zeros to be filled. The fp32 main weights are in it
        when this run has them, at a load when the checkpoint does. Collective when saving (the distributed
        optimizer gathers)."""
        loading = metadata is not None
        weights = ("fp32_param",) if (metadata.get("fp32_param", False) if loading else self.main.half) else ()
        kept = (MOMENTS + MOMENTUM if self.muon_steps else MOMENTS) + weights  # Muon: no distributed optimizer
        full = {} if loading else self.main.full_state(self.optimizer, kept)
        return {"state": optimizer_tensors(self.chunks, model_sharded_state_dict, full,
                                           lambda p: self._moments(p) + weights),
                "step": self.steps(), "fp32_param": bool(weights)}

    def _moments(self, param: torch.nn.Parameter) -> tuple[str, ...]:
        return MOMENTUM if self.muon_steps and self.muon_steps(param) else MOMENTS

    def load_state_dict(self, state_dict: dict) -> None:
        """The moments and the step; the fp32 main weights when the checkpoint has them (else they stay the
        loaded model weights)."""
        self.load_whole_state(loaded_by_parameter(self.chunks, state_dict["state"]), state_dict["step"])

    def whole_state(self) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
        """AdamW's moments and the fp32 main weights of every held parameter, whole, by id of the model parameter,
        and the step: what Megatron-LM's legacy files hold (legacy_save.py). Collective for the distributed
        optimizers."""
        return self.main.full_state(self.optimizer, MOMENTS + ("fp32_param",)), self.steps()

    def load_whole_state(self, states: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        """The moments (and the fp32 main weights, where given) of every held parameter, as whole_state gives them."""
        self.main.load_full_state(self.optimizer, states, step)

    def steps(self) -> int:
        steps = [int(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return max(steps, default=0)


@dataclass(frozen=True)
class LegacyStates:
    """The states of ``names`` as Megatron-LM's legacy per-rank files (--ckpt-format torch) hold them, each in
    its own form there (legacy_save.py writes them, legacy.py reads them): the model's down-pipeline chunk as
    ``model``; the optimizer, with the loss scale (--fp16) inside it and the LR scheduler beside it, as
    ``optimizer`` and ``opt_param_scheduler``; the RNG states as ``rng_state``. ``None``, False: left out of
    this save or load (--no-save-optim, --no-load-optim, --no-load-rng, another layout)."""

    model: ModelChunks
    optimizer: OptimizerState | None
    scheduler: Stateful | None
    scaler: Stateful | None
    rng: bool

    @classmethod
    def of(cls, states: dict, names: list[str]) -> LegacyStates:
        kept = {name: states[name] for name in names}
        return cls(kept["model"], kept.get("optimizer"), kept.get("lr_scheduler"), kept.get("grad_scaler"),
                   "rng" in kept)


@dataclass(frozen=True)
class RNGState:
    """This process's random generators (Python's, torch's, CUDA's, megatron-core's tracker), saved as rank
    ``rank`` of ``world``: a load restores them only in the same layout, where each rank is the same."""

    rank: int
    world: int

    def sharded_state_dict(self, metadata: dict | None = None) -> dict:
        """This rank's generators (``metadata``, the checkpoint's at a load, changes nothing)."""
        return rng_state(self.rank, self.world)

    def load_state_dict(self, state_dict: dict) -> None:
        restore_rng(state_dict)


@dataclass
class DataPosition:
    """How far the run has read its data: ``iteration`` iterations, ``consumed_samples`` samples (without
    a record of them, ``global_batch_size`` per iteration)."""

    global_batch_size: int
    iteration: int = 0
    consumed_samples: int = 0

    @classmethod
    def after(cls, iteration: int, global_batch_size: int) -> DataPosition:
        return cls(global_batch_size, iteration, iteration * global_batch_size)

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state_dict: dict) -> None:
        self.iteration = state_dict["iteration"]
        self.consumed_samples = state_dict.get("consumed_samples", self.iteration * self.global_batch_size)
