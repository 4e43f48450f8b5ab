"""The main weights: what the optimizer steps, and what the trainer and the checkpoints read gradients,
norms and optimizer state through. One protocol, three implementations, one place that picks among them:

- ``MainParams`` (precision.py): every rank steps all its main parameters (the model's own in fp32, fp32
  copies of fp16 or bf16 weights), reduced by ``ReplicaGradSync`` (gradients.py);
- ``ShardedMainParams`` (distributed_optimizer.py, --use-distributed-optimizer): each rank steps its shard
  of every stage's replica group, and is its own gradient sync (reduce-scatters);
- ``LayerWiseMainParams`` (layer_wise.py, --optimizer muon with --use-distributed-optimizer): whole
  parameters dealt to the members of each replica group, gradients reduced as without it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..config.train_spec import OptimizerSpec
from .distributed_optimizer import ShardedMainParams
from .gradients import ReplicaGradSync
from .layer_wise import LayerWiseMainParams
from .muon import mark_parameters
from .precision import MainParams


class MainWeights(Protocol):
    """What the trainer, the checkpoints (checkpoint/states.py) and the log series call of the main weights.
    The norms and the zeros count are collective (every rank calls them, each logical parameter counts once)."""

    half: bool
    """Whether the main weights are fp32 copies of fp16 or bf16 model weights (saved as ``fp32_param``)."""

    def all(self) -> list[torch.nn.Parameter]:
        """Every main parameter this rank holds, whose ``.grad`` the iteration accumulates and reduces."""

    def stepped(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """What this rank's optimizer steps, each as (the model parameter whose rules it follows, the main
        parameter)."""

    def zero_grad(self, optimizer) -> None:
        """Zero every gradient in place (they are views of persistent buffers) before an iteration."""

    def unscale(self, scale: float) -> None:
        """Divide the gradients by --fp16's loss scale."""

    def grad_norm(self) -> float:
        """The gradient's L2 norm over the whole model (collective)."""

    def params_norm(self) -> float:
        """Megatron-LM's params norm, --log-params-norm (collective)."""

    def zeros(self) -> int:
        """The zeros of the whole model's gradient, --log-num-zeros-in-grad (collective)."""

    def clip(self, max_norm: float, norm: float) -> None:
        """Scale the gradients down to ``max_norm`` given their global ``norm`` (--clip-grad)."""

    def copy_to_model(self) -> None:
        """After a step: the model runs on the updated main weights (for the distributed optimizer, after
        its gather, which --overlap-param-gather leaves pending)."""

    def flush(self) -> None:
        """Finish what is pending (weight gathers) before anything but a forward reads the weights."""

    def copy_from_model(self) -> None:
        """After loading model weights without their fp32 main copies: the main weights take them."""

    def full_state(self, optimizer, names: tuple[str, ...]) -> dict[int, dict[str, torch.Tensor]]:
        """Each named optimizer state (and ``fp32_param``) of every model parameter, whole, by id of the model
        parameter, for a checkpoint (collective for the distributed optimizers)."""

    def load_full_state(self, optimizer, states: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        """The optimizer state (and the fp32 main weights) from a checkpoint's whole tensors, as
        ``full_state`` gives them."""

    def state_bytes(self) -> tuple[int, int]:
        """(main parameters, gradients) in bytes, for the model-state line."""


def build_main(chunks: dict, rt, spec: OptimizerSpec) -> tuple[MainWeights, ReplicaGradSync]:
    """The main weights of this rank's ``chunks`` (``{(pipeline, stage): chunk}``) that ``spec`` asks for, and the
    gradient sync our executor and megatron-core's schedules start reductions through."""
    tied = len(rt.embedding_stages) > 1  # the word embedding has copies on several stages
    if spec.name == "muon":
        mark_parameters(list(chunks.values()))
    if spec.layer_wise:
        main = LayerWiseMainParams(chunks, rt, tied)
        return main, ReplicaGradSync(main.by_chunk, rt, spec.overlap_grad_reduce)
    if spec.distributed:
        main = ShardedMainParams(chunks, rt, tied, spec.overlap_grad_reduce, spec.overlap_param_gather)
        return main, main
    main = MainParams(chunks, rt, tied)
    return main, ReplicaGradSync(main.by_chunk, rt, spec.overlap_grad_reduce)
