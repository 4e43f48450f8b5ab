"""The optimizer state of Megatron-LM's legacy per-rank files (--ckpt-format torch), written and read by
megatron-core's own optimizer classes.

Megatron-LM's ``generate_state_dict`` stores ``optimizer.state_dict()`` of what ``get_megatron_optimizer``
built over the rank's model chunk: a ChainedOptimizer of one optimizer for the dense parameters and, when
the model has experts, one for theirs (its state dict a list of the two), each an FP32Optimizer (fp32: torch's
optimizer state dict) or a Float16OptimizerWithFloat16Params (--bf16, --fp16: ``optimizer``, ``grad_scaler``,
``fp32_from_fp16_params``). The torch optimizer keys each parameter's state by its index in the parameter
groups, megatron-core's ``_get_param_groups`` of the chunk under Megatron-LM's ``get_megatron_optimizer_config``.

Here the same objects are built over one stage's chunk: megatron-core's parameter groups under the config
Megatron-LM derives from the args the checkpoint's run had, torch's AdamW over them holding this trainer's
moments, step and fp32 main weights (by model parameter: ``MainWeights.full_state``), with the learning rate
and weight decay megatron-core's scheduler gives each group; megatron-core's ``state_dict`` writes them and its
``load_state_dict`` reads them back, so the group order and keys are megatron-core's by construction. Its
wrappers are made without their constructors, which allocate CUDA tensors (a loss scale, an overflow flag)
and take CUDA parameters only; neither method reads what they skip. The inner optimizer is torch's AdamW,
megatron-core's own without Transformer Engine or apex (and the one this trainer steps), which counts steps
per parameter; the count is also set per group, where TE's and apex's FusedAdam read it.
"""
from __future__ import annotations

import copy

import torch
from megatron.core.optimizer import _get_param_groups
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.training.training import get_megatron_optimizer_config

MOMENTS = ("exp_avg", "exp_avg_sq")


def megatron_groups(chunks: list[torch.nn.Module], megatron_args) -> tuple[object, list[list[list[dict]]]]:
    """megatron-core's optimizer config for Megatron-LM's ``megatron_args`` and its parameter groups over
    ``chunks``, per chunk: the groups of each optimizer get_megatron_optimizer chains (the dense parameters', then
    the experts' if any group is theirs), each group holding that chunk's parameters only. Collective:
    megatron-core gathers every rank's group keys, so every rank calls this once, whichever chunks it writes or
    reads."""
    config, overrides = get_megatron_optimizer_config(megatron_args)
    groups = _get_param_groups(chunks, config, overrides)
    parts = [[g for g in groups if not g["is_expert_parallel"]], [g for g in groups if g["is_expert_parallel"]]]
    parts = parts if parts[1] else parts[:1]
    per_chunk = []
    for chunk in chunks:
        own = {id(p) for p in chunk.parameters()}
        per_chunk.append([[{**g, "params": [p for p in g["params"] if id(p) in own]} for g in part] for part in parts])
    return config, per_chunk


def _wrapper(cls, **attributes):
    """megatron-core's optimizer class ``cls`` holding ``attributes`` (see the module's docstring)."""
    wrapper = object.__new__(cls)
    wrapper.__dict__.update(attributes, is_stub_optimizer=False)
    return wrapper


def _chained(config, parts: list[list[dict]], main_of, half: bool, scaler) -> ChainedOptimizer:
    """megatron-core's optimizer over ``parts`` (megatron_groups' of one chunk), its torch optimizers stepping
    ``main_of(parameter)``: the parameter itself, or in half precision its fp32 main weight."""
    chained = []
    for groups in parts:
        inner = torch.optim.AdamW([{**g, "params": [main_of(p) for p in g["params"]]} for g in groups], lr=config.lr,
                                  weight_decay=config.weight_decay, betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_eps, capturable=config.optimizer_cuda_graph)
        if not half:
            chained.append(_wrapper(FP32Optimizer, optimizer=inner, config=config))
            continue
        copies = [[main_of(p) for p in g["params"] if p.dtype != torch.float32] for g in groups]
        chained.append(_wrapper(Float16OptimizerWithFloat16Params, optimizer=inner, config=config,
                                grad_scaler=scaler, fp32_from_float16_groups=copies))
    return ChainedOptimizer(chained)


def optimizer_state_dict(parts: list[list[dict]], config, whole: dict, step: int, scheduler, scaler, half: bool):
    """Megatron-LM's ``optimizer`` entry for one chunk (``parts``: megatron_groups' of it) holding ``whole``
    (``MainWeights.full_state``: id(model parameter) -> its moments and fp32 main weight) and ``step``, each
    group's learning rate and weight decay set by megatron-core's ``scheduler`` rule at its current step."""
    main_of = (lambda p: whole[id(p)]["fp32_param"]) if half else (lambda p: p)
    optimizer = _chained(config, parts, main_of, half, scaler)
    for part, chained in zip(parts, optimizer.chained_optimizers):
        for group in chained.optimizer.param_groups:
            group["step"] = step  # where TE's and apex's FusedAdam count it
        for p in (p for g in part for p in g["params"]):
            chained.optimizer.state[main_of(p)] = {"step": torch.tensor(float(step)),
                                                   **{name: whole[id(p)][name] for name in MOMENTS}}
    ruled = copy.copy(scheduler)
    ruled.optimizer = optimizer
    ruled.step(0)  # sets each group's lr and weight_decay as its last step did
    return optimizer.state_dict()


def loaded_state(parts: list[list[dict]], config, saved, half: bool) -> tuple[dict, int]:
    """What Megatron-LM's ``optimizer`` entry ``saved`` holds for one chunk (``parts``: megatron_groups' of it),
    read by megatron-core's ``load_state_dict``: id(model parameter) -> its moments (and, in half precision,
    fp32 main weight), and the step."""
    copies = {id(p): torch.zeros(p.shape, dtype=torch.float32, device=p.device)
              for part in parts for g in part for p in g["params"] if p.dtype != torch.float32}
    main_of = lambda p: copies.get(id(p), p)  # noqa: E731
    optimizer = _chained(config, parts, main_of, half, scaler=None)
    optimizer.load_state_dict(saved)
    states, steps = {}, set()
    for chained in optimizer.chained_optimizers:
        for group in chained.optimizer.param_groups:
            for main in group["params"]:  # torch's AdamW counts per parameter, TE's and apex's per group
                steps.add(int(chained.optimizer.state[main].get("step", group.get("step", 0))))
    for part, chained in zip(parts, optimizer.chained_optimizers):
        for p in (p for g in part for p in g["params"]):
            state = chained.optimizer.state[main_of(p)]
            states[id(p)] = {name: state.get(name, torch.zeros_like(main_of(p))) for name in MOMENTS}
            if id(p) in copies:
                states[id(p)]["fp32_param"] = copies[id(p)]
    assert len(steps) <= 1, f"the checkpoint's parameters were stepped different numbers of times: {sorted(steps)}"
    return states, steps.pop() if steps else 0
