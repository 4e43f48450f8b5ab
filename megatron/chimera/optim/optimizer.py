"""The optimizer over the main weights (main.py): megatron-core's parameter groups, AdamW (adam.py) or Muon
and AdamW (muon.py), its state allocated at once; and the model state a rank holds with it, in bytes."""
from __future__ import annotations

from typing import NamedTuple

import torch
from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import OptimizerConfig

from ..config.train_spec import OptimizerSpec
from .adam import adam_state, build_adamw
from .main import MainWeights
from .muon import build_muon


def param_groups(models: list[torch.nn.Module], stepped: list[tuple], spec: OptimizerSpec) -> list[dict]:
    """megatron-core's parameter groups, as its get_megatron_optimizer builds them (_get_param_groups with the
    standard overrides): no weight decay on biases and 1-D parameters (norms), but on the query and key norms
    with --apply-wd-to-qk-layernorm; with --decoupled-lr the input embedding and output layer on their own LR
    schedule; routed experts apart. Built over the model ``models``, then filled with the main parameters of
    ``stepped`` ((model parameter, main parameter) pairs: a piece of the distributed optimizer follows the
    parameter it is cut from); the groups with none of them here are left out. Collective: megatron-core
    gathers every rank's groups."""
    config = OptimizerConfig(lr=spec.lr, min_lr=spec.min_lr, decoupled_lr=spec.decoupled_lr,
                             decoupled_min_lr=spec.decoupled_min_lr,
                             apply_wd_to_qk_layernorm=spec.apply_wd_to_qk_layernorm)
    groups = _get_param_groups(models, config, get_standard_config_overrides(config))
    group_of = {id(p): i for i, group in enumerate(groups) for p in group["params"]}
    members = [[] for _ in groups]
    for model, main in stepped:
        assert id(model) in group_of, f"a parameter of shape {tuple(model.shape)} is in no parameter group"
        members[group_of[id(model)]].append(main)
    out = []
    for group, params in zip(groups, members):
        if group["default_config"]:  # --lr and --min-lr: the scheduler's own rule (a loaded one's, kept or not)
            del group["max_lr"], group["min_lr"]
        if params:
            out.append({**group, "params": params})
    return out


def _allocate_state(optimizer) -> None:
    """AdamW's state as its first step would create it (zero moments, step 0), allocated now so the
    model-state line counts real tensors; for the parameters Muon steps, Muon has allocated its own."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in optimizer.state:
                optimizer.state[p] = adam_state(optimizer, p, 0, torch.zeros_like(p), torch.zeros_like(p))


def build_optimizer(main: MainWeights, spec: OptimizerSpec, device: torch.device, models: list[torch.nn.Module]):
    """AdamW, or with --optimizer muon Muon and AdamW, over what ``main`` steps of the held model chunks
    ``models``, its state allocated. Collective (the parameter groups)."""
    groups = param_groups(models, main.stepped(), spec)
    optimizer = build_muon(groups, spec, device, models) if spec.name == "muon" else build_adamw(groups, spec, device)
    _allocate_state(optimizer)
    return optimizer


class ModelStateBytes(NamedTuple):
    """A rank's model state in bytes, counted from its tensors: the model's weights, fp32 main weights that are
    copies (half precision), the fp32 gradients of an iteration, and the optimizer's state (AdamW's two moments
    per parameter; with --optimizer muon, Muon's one momentum per matrix element)."""

    parameters: int
    main_parameters: int
    gradients: int
    optimizer: int


def model_state_bytes(models: list[torch.nn.Module], main: MainWeights, optimizer) -> ModelStateBytes:
    params = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
    main_params, grads = main.state_bytes()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    return ModelStateBytes(params, main_params, grads, state)
