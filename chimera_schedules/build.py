"""One entry point from options to a validated schedule, shared by the CLI and the training program.

Options that do not apply to the chosen schedule are rejected rather than ignored, so a typo such as
``--schedule 1f1b --pipelines 4`` fails loudly instead of silently describing another schedule."""
from __future__ import annotations

from .baselines import gpipe, interleaved, one_f_one_b
from .chimera import CONCATS, chimera
from .errors import require
from .ir import Schedule
from .search import best_order
from .simulator import CostModel
from .validator import validate

SCHEDULES = ("gpipe", "1f1b", "interleaved", "chimera")
ORDERS = ("paper", "best")


def build(schedule: str, stages: int, microbatches: int, *, chunks: int | None = None,
          pipelines: int | None = None, concat: str | None = None, order: str | None = None,
          costs: CostModel | None = None) -> Schedule:
    """The schedule the options describe, validated. ``None`` means the option was not given."""
    require(schedule in SCHEDULES, "--schedule", schedule, f"must be one of {', '.join(SCHEDULES)}")
    require(stages >= 1, "--stages", stages, "must be at least 1")
    require(microbatches >= 1, "--microbatches", microbatches, "must be at least 1")
    if costs is not None:
        require(_positive(costs.forward), "--forward-time", costs.forward, "must be positive")
        require(_positive(costs.backward), "--backward-time", costs.backward, "must be positive")
    if schedule != "interleaved":
        require(chunks in (None, 1), "--chunks", chunks, "applies to --schedule interleaved only")
    if schedule != "chimera":
        for option, value in (("--pipelines", pipelines), ("--concat", concat), ("--order", order)):
            require(value is None, option, value, "applies to --schedule chimera only")

    if schedule == "gpipe":
        result = gpipe(stages, microbatches)
    elif schedule == "1f1b":
        result = one_f_one_b(stages, microbatches)
    elif schedule == "interleaved":
        result = interleaved(stages, microbatches, 2 if chunks is None else chunks)
    else:
        order = order or "paper"
        concat = concat or "direct"
        require(order in ORDERS, "--order", order, f"must be one of {', '.join(ORDERS)}")
        require(concat in CONCATS, "--concat", concat, f"must be one of {', '.join(CONCATS)}")
        if order == "best":
            require(concat == "direct", "--concat", concat,
                    "--order best builds its own order for N = K x D; use --concat direct")
            result = best_order(stages, microbatches, costs, pipelines or 2)
        else:
            result = chimera(stages, microbatches, pipelines or 2, concat, costs)
    validate(result)
    return result


def _positive(value) -> bool:
    values = [value] if isinstance(value, (int, float)) else list(value)
    return bool(values) and all(v > 0 for v in values)
