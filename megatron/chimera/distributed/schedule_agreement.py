"""Every rank runs the schedule it generated itself; this checks, before iteration 1, that all ranks
generated the same one. Flags that differ across a launch, or another OR-Tools build on some node
(``--chimera-order best`` searches on each rank), would otherwise pair messages wrongly or hang."""
from __future__ import annotations

import hashlib

import torch.distributed as dist

from chimera_schedules import ConfigError


class ScheduleMismatch(ConfigError):
    """Raised alike on every rank (each sees every digest), so rank 0 alone prints it."""


def schedule_digest(plan) -> str:
    """A short hash of everything the ranks must agree on: the lowered lists, or for megatron-core's
    schedules the placement and micro-batches; and the layout (--balance-pipeline-layout computes it
    on every rank)."""
    text = plan.lowered.dumps() if plan.lowered is not None else repr((plan.placement, plan.microbatches))
    text += str(plan.layout)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def agree_on_schedule(plan) -> str:
    """Collective: every rank's digest to every rank. Returns the common digest; raises
    ScheduleMismatch naming which ranks built which schedule (and the schedule the run resolved)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, schedule_digest(plan))
    if len(set(everyone)) == 1:
        return everyone[0]
    ranks: dict[str, list[int]] = {}
    for rank, digest in enumerate(everyone):
        ranks.setdefault(digest, []).append(rank)
    built = "; ".join(f"ranks {_span(r)} built {d}" for d, r in ranks.items())
    raise ScheduleMismatch("--pipeline-schedule", plan.name,
                           f"the ranks built different schedules ({built}): give every rank the same flags, and "
                           "the same OR-Tools build for --chimera-order best")


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2 else \
        ", ".join(map(str, ranks))
