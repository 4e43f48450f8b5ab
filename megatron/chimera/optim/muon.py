"""--optimizer muon: megatron-core's TensorParallelMuon (from the emerging-optimizers package) for the hidden
weight matrices, AdamW (optim/adam.py) for the rest, as megatron-core splits them: the embedding, the output
layer and every parameter that is not 2-D (norms, biases) go to --muon-scalar-optimizer (adam).

megatron-core builds it in ``_get_megatron_emerging_optimizer`` over its DDP buffers and wrappers, which this
trainer does not use; what it does to the parameters is done here with its own pieces: its tags (the fused
QKV weight orthogonalised per query, key and value; experts over the expert TP group), its registry's
constructor and state initialisation, its OptimizerConfig built from the --muon-* flags, and its process
groups. The orthogonalisation of a TP-split matrix is megatron-core's too: per shard (--muon-tp-mode
blockwise, Megatron-LM's default), gathered whole over the TP group (duplicated), or distributed over it.

Muon is deterministic given its gradients, so the two copies of a Chimera stage, whose gradients are
identical after the replica reduction, take identical steps. Its state is one fp32 momentum per matrix
(``momentum_buffer``, saved as megatron-core saves it: ``optimizer.state.momentum_buffer.<parameter key>``).
"""
from __future__ import annotations

import torch
from megatron.core.optimizer.emerging_optimizers import (
    _create_emerging_optimizer,
    _get_qkv_split_shapes,
    _is_nonlinear_or_embedding,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import ProcessGroupCollection

from ..config.train_spec import OptimizerSpec
from .adam import adam_state, build_adamw

MOMENTUM = "momentum_buffer"
GROUPS = ["tp", "expt_tp", "gtp_remat", "expt_gtp_remat"]  # the groups TensorParallelMuon reads


def steps_with_muon(param: torch.Tensor) -> bool:
    """megatron-core's rule (the muon registry entry's default override): 2-D, not the embedding or output layer."""
    return not _is_nonlinear_or_embedding(param)


def mark_parameters(chunks: list[torch.nn.Module]) -> None:
    """megatron-core's tags, set before the main parameters copy the model's attributes (half precision)."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if "experts" in name and "shared" not in name:
                param.expert_tp = True
            if "linear_qkv.weight" in name and param.dim() == 2:
                shapes = _get_qkv_split_shapes(chunk.config)
                if param.shape[0] % sum(shapes) == 0:
                    param.is_qkv, param.qkv_split_shapes = True, shapes


class MuonAndAdamW:
    """Muon and AdamW stepped as one optimizer: both optimizers' parameter groups (the LR schedule sets each
    group's learning rate and weight decay) and one state map keyed by parameter, which the checkpoint,
    the model-state line and the harness read."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], defaults: dict):
        self.optimizers, self.defaults = optimizers, defaults
        self.state = optimizers[0].state
        for optimizer in optimizers[1:]:
            optimizer.state = self.state
        self.param_groups = [group for optimizer in optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def _split(param_groups: list[dict], muon: bool) -> list[dict]:
    groups = [{**g, "params": [p for p in g["params"] if steps_with_muon(p) == muon]} for g in param_groups]
    return [g for g in groups if g["params"]]


def build_muon(param_groups: list[dict], spec: OptimizerSpec, device: torch.device,
               chunks: list[torch.nn.Module]) -> MuonAndAdamW:
    """Muon for the groups' matrices, its momentum allocated (megatron-core's init_state_fn), and AdamW for
    the rest. ``chunks``: the held model chunks (megatron-core reads the QKV split from their config)."""
    config = OptimizerConfig(optimizer="muon", lr=spec.lr, weight_decay=spec.weight_decay, **spec.muon)
    groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=GROUPS)
    optimizers = []
    if matrices := _split(param_groups, muon=True):
        muon, init_state = _create_emerging_optimizer(config, matrices, "muon", chunks, groups)
        init_state(muon)
        optimizers.append(muon)
    rest = _split(param_groups, muon=False)
    adamw = build_adamw(rest, spec, device) if rest else None
    optimizers += [adamw] if adamw else []
    return MuonAndAdamW(optimizers, adamw.defaults if adamw else {})


def loaded_state(optimizer, param: torch.Tensor, step: int, saved: dict[str, torch.Tensor]) -> dict:
    """A parameter's optimizer state from a checkpoint's tensors: Muon's momentum, or AdamW's moments and step."""
    if MOMENTUM in saved:
        return {MOMENTUM: saved[MOMENTUM]}
    return adam_state(optimizer, param, step, saved["exp_avg"], saved["exp_avg_sq"])
