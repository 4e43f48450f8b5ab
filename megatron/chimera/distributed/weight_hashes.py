"""--check-weight-hash-across-dp-replicas-interval: every copy of every stage holds the same weights.

Megatron-LM's check (megatron-core's ``check_param_hashes_across_dp_replicas``) hashes each parameter
with SHA-1 and compares the hashes over the data-parallel group (the expert-data-parallel group for
routed experts). Under Chimera a stage has copies in every pipeline too, on other pipeline ranks, and
the invariant the trainer keeps is that all of them match: so the hashes are compared over each stage's
replica group (every pipeline and data-parallel replica, one tensor-parallel rank), and over its expert
replica group for experts that expert parallelism spreads. Stages are taken in one global order, each
rank those it holds (as the gradient reductions are), so the gathers cannot deadlock; then every rank
learns of any mismatch, and the run stops on all of them, one line naming the stage and the ranks.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


class WeightHashMismatch(RuntimeError):
    """Raised on every rank; one line naming the stage copies that differ."""


def check_weight_hashes(chunks: dict, rt, iteration: int) -> None:
    """Collective (every rank). ``chunks``: (pipeline, stage) -> this rank's chunk of that copy."""
    found = []
    for stage in sorted({stage for _, stage in chunks}):
        copies = [chunk for (_, s), chunk in sorted(chunks.items()) if s == stage]
        for expert, group in ((False, rt.stage_groups.get(stage)), (True, rt.expert_groups.get(stage))):
            names = [name for name, p in copies[0].named_parameters() if _is_spread_expert(p) == expert]
            if names:
                hashes = [_hashes(chunk, expert) for chunk in copies]
                found += _compare(f"stage {stage} (tensor-parallel rank {rt.tp_rank})", names, hashes, group, rt)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    lines = sorted({line for per_rank in everyone for line in per_rank})
    if lines:
        raise WeightHashMismatch(f"weight hashes differ after {iteration} iterations: {lines[0]}"
                                 + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""))


def _is_spread_expert(param: torch.Tensor) -> bool:
    """megatron-core's mark for experts reduced over expert groups (expert parallelism or a TP of their own)."""
    return not getattr(param, "allreduce", True)


def _hashes(chunk, expert: bool) -> torch.Tensor:
    """One row per parameter (the experts that expert parallelism spreads, or the others): as megatron-core
    hashes a parameter, SHA-1 of its values as fp32 on the host."""
    return torch.stack([torch.frombuffer(bytearray(hashlib.sha1(p.detach().cpu().float().numpy()).digest()),
                                         dtype=torch.uint8)
                        for p in chunk.parameters() if _is_spread_expert(p) == expert])


def _compare(what: str, names: list[str], hashes: list[torch.Tensor], group, rt) -> list[str]:
    """This rank's copies of a stage (``hashes``, one per copy it holds: several with more than two pipelines)
    against each other, then its first against every member of the stage's replica ``group``: a line where
    they differ (every member of the group sees, and says, the same)."""
    lines = [f"{what}: the copies rank {rt.rank} holds differ from each other (first in {names[_first(hashes)]})"
             for other in hashes[1:] if not torch.equal(other, hashes[0])][:1]
    if group is None:  # no other rank holds the stage
        return lines
    ranks = dist.get_process_group_ranks(group)
    gathered = torch.empty(len(ranks) * hashes[0].numel(), dtype=torch.uint8, device=rt.device)
    rt.all_gather(gathered, hashes[0].to(rt.device).flatten(), group)
    members = list(gathered.cpu().view(len(ranks), *hashes[0].shape))
    differing = [rank for rank, h in zip(ranks, members) if not torch.equal(h, members[0])]
    if differing:
        lines.append(f"{what}: the copies on ranks {differing} differ from the copy on rank {ranks[0]} (first in "
                     f"{names[_first(members)]}; the stage's copies are on ranks {ranks})")
    return lines


def _first(hashes: list[torch.Tensor]) -> int:
    """The first parameter whose hash differs between any two of ``hashes``."""
    return next(i for i in range(len(hashes[0])) if any(not torch.equal(h[i], hashes[0][i]) for h in hashes))
