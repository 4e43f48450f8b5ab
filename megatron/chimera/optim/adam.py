"""AdamW as the trainer steps it: torch's fused kernel on a GPU, torch's default on the CPU.

megatron-core 0.19 (megatron/core/optimizer/__init__.py) steps with Transformer Engine's FusedAdam, else
apex's, else torch.optim.AdamW, whose CUDA default (foreach) holds an fp32 tensor the size of a whole
parameter group at the step: about 4 bytes per parameter beyond the model state. torch's own
``fused=True`` is one multi-tensor kernel, as TE's and apex's are, and allocates nothing. It is the one
used here: it needs no detection of TE's or apex's kernels (an install can import and lack them), and it
is the same AdamW with the same state (``exp_avg``, ``exp_avg_sq`` and a step count per parameter), so
checkpoints, the model-state line and the CPU runs stay as they are; TE's and apex's FusedAdam keep one
step count per parameter group instead.

On the CPU torch's default stays (a loop over the parameters): the fp32 reference the equivalence tests
compare layouts against. The memory this choice costs at the step: planner.step_bytes.
"""
from __future__ import annotations

import torch

from ..config.train_spec import OptimizerSpec


def adam_options(device: torch.device | str) -> dict:
    """The implementation keyword for parameters on ``device``: fused on CUDA, torch's default elsewhere."""
    return {"fused": True} if torch.device(device).type == "cuda" else {}


def build_adamw(param_groups: list[dict], spec: OptimizerSpec, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups, lr=spec.lr, weight_decay=spec.weight_decay, betas=spec.betas,
                             eps=spec.eps, **adam_options(device))


def adam_state(optimizer: torch.optim.AdamW, param: torch.Tensor, step: int, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor) -> dict[str, torch.Tensor]:
    """One parameter's state, as torch's AdamW would create it: the step count on the parameter's device
    when fused (its kernel reads it there), on the CPU otherwise."""
    where = param.device if optimizer.defaults.get("fused") else torch.device("cpu")
    return {"step": torch.tensor(float(step), device=where), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
