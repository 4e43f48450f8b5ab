"""--optimizer muon with --use-distributed-optimizer: megatron-core's layer-wise distributed optimizer, which
keeps every matrix whole (Muon orthogonalises whole matrices) and spreads the parameters, not flat shards of
them, over each stage's replica group.

Gradients are reduced as without it (every copy holds the whole reduced gradient). Each parameter of a stage
is stepped by one member of the stage's replica group, its owner (the parameters taken in turn, Muon's and
AdamW's each from the first member, routed experts over their expert replica group), which alone holds its
optimizer state; after the step every member receives the owner's weights. The exchange is an all-reduce in
which only the owner adds its value (every other member adds zeros), so it is exact, runs through the same
groups and staging as the gradient reduction, and happens once per stage whatever the copies a rank holds.
A checkpoint gathers the owners' states the same way, so it is the same checkpoint as without the flag.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .gradients import is_expert
from .muon import MOMENTUM, steps_with_muon
from .precision import MainParams


class LayerWiseMainParams(MainParams):
    """MainParams whose optimizer steps only the parameters this rank owns (``stepped``)."""

    def __init__(self, chunks: dict, rt, tied: bool):
        super().__init__(chunks, rt, tied)
        rank = dist.get_rank()
        self.stages = {}  # stage -> [(group, positions in a copy's parameter list, their owners)]
        for (_, stage), params in sorted(self.by_chunk.items()):
            if stage not in self.stages:
                groups = ((rt.stage_groups.get(stage), False), (rt.expert_groups.get(stage), True))
                parts = [(g, [i for i, p in enumerate(params) if is_expert(p) == expert]) for g, expert in groups]
                self.stages[stage] = [(g, at, _owners([params[i] for i in at], g)) for g, at in parts if at]
        self.mine = {id(params[i]) for stage, parts in self.stages.items() for params in self._copies(stage)
                     for _, at, owners in parts for i, owner in zip(at, owners) if owner == rank}

    def stepped(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        return [(model, main) for model, main in self._model_and_main() if id(main) in self.mine]

    def zero_grad(self, optimizer) -> None:
        """Every gradient, the optimizer holding only the owned parameters."""
        for p in self.all():
            if p.grad is not None:
                p.grad.zero_()
        self._point_main_grads()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After a step: every member takes the owners' weights, into each copy it holds."""
        for stage, parts in sorted(self.stages.items()):
            copies = self._copies(stage)
            for group, at, owners in parts:
                values = self._from_owners(group, owners, [copies[0][i].detach() for i in at])
                for params in copies:
                    for i, value in zip(at, values):
                        params[i].copy_(value)
        super().copy_to_model()

    def _from_owners(self, group, owners: list[int], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor as its owner holds it: an all-reduce to which only the owner adds (exact)."""
        rank = dist.get_rank()
        if not tensors:  # the same on every member: no state of this name in this part
            return []
        flat = _flatten_dense_tensors([t if o == rank else torch.zeros_like(t) for t, o in zip(tensors, owners)])
        if group is not None:
            self.rt.all_reduce(flat, group=group)
        return _unflatten_dense_tensors(flat, tensors)

    def _copies(self, stage: int) -> list[list[torch.nn.Parameter]]:
        return [params for (_, s), params in sorted(self.by_chunk.items()) if s == stage]

    def full_state(self, optimizer, names: tuple[str, ...]) -> dict[int, dict[str, torch.Tensor]]:
        """Collective over each replica group: every parameter's state from its owner, whole, by model parameter."""
        by_main = {id(p): {"fp32_param": p.detach()} if "fp32_param" in names else {} for p in self.all()}
        for stage, parts in sorted(self.stages.items()):
            copies = self._copies(stage)
            for group, at, owners in parts:
                for name in (n for n in names if n != "fp32_param"):
                    wanted = [(i, o) for i, o in zip(at, owners) if name in _names(copies[0][i])]
                    tensors = [_state(optimizer, copies[0][i], name) for i, _ in wanted]
                    values = self._from_owners(group, [o for _, o in wanted], tensors)
                    for params in copies:
                        for (i, _), value in zip(wanted, values):
                            by_main[id(params[i])][name] = value.clone()
        return {id(model): by_main[id(main)] for model, main in self._model_and_main()}

    @torch.no_grad()
    def load_full_state(self, optimizer, states: dict, step: int) -> None:
        """Every parameter's state as the checkpoint has it, kept for the owned ones only."""
        super().load_full_state(optimizer, states, step)
        for p in self.all():
            if id(p) not in self.mine:
                optimizer.state.pop(p, None)


def _owners(params: list, group) -> list[int]:
    """The owner of each parameter: Muon's and AdamW's parameters each dealt in turn from the first member, so
    that the first (rank 0 among them, which writes the checkpoint's step count) holds an AdamW step count."""
    members = sorted(dist.get_process_group_ranks(group)) if group is not None else [dist.get_rank()]
    turn = {True: 0, False: 0}
    owners = []
    for p in params:
        muon = steps_with_muon(p)
        owners.append(members[turn[muon] % len(members)])
        turn[muon] += 1
    return owners


def _names(param) -> tuple[str, ...]:
    return (MOMENTUM,) if steps_with_muon(param) else ("exp_avg", "exp_avg_sq")


def _state(optimizer, param, name: str) -> torch.Tensor:
    """The owner's state; zeros on the other members (whose all-reduce contribution is ignored anyway)."""
    return optimizer.state.get(param, {}).get(name, torch.zeros_like(param))
