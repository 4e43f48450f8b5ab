"""Stage costs measured on the run's own devices, as the planner prices stages with them.

The trainer measures them at startup under ``--pipeline-schedule auto`` (megatron/chimera/stage_costs.py),
and ``python -m megatron.chimera.profile`` writes the same measurement to a file that ``--pipeline-profile``
reads back. What is measured: one micro-batch's forward and backward through each part a stage is made of,
at each micro-batch size the plan may pick, on one device holding the part whole (no tensor, context or
expert parallelism):

- ``layer``: a dense transformer layer;
- ``moe_layer``: an MoE transformer layer with the experts one expert-parallel rank holds (its tokens' share
  of the expert work, without the all-to-all, which the hardware profile prices);
- ``output``: the output layer and the loss, with the final norm and the embedding's lookup (the two ends
  of the model, which no layout separates from the loss in cost that matters);
- ``mtp``: one multi-token-prediction layer with its own output layer.

A stage's forward and backward are the sums of its parts', divided over the tensor- and context-parallel
ranks that share it (the FLOP count's assumption too), plus the all-to-all of its MoE layers at the hardware
profile's rates. Everything else (messages, reductions, memory) stays the hardware profile's.

The file (JSON): ``{"name", "source", "stage_costs": {"<micro-batch size>": {"<part>": [forward s, backward
s], ...}, ...}}``. A size the file lacks is priced from the nearest size it has, in proportion.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ..ir.costs import CostModel
from ..ir.layout import Layout
from .planner import ModelShape, Profile, StageCosts, all_to_all, costs, stage_layers

PARTS = ("layer", "moe_layer", "output", "mtp")
KEY = "stage_costs"


@dataclass(frozen=True)
class PassTimes:
    """Seconds of one micro-batch's forward and backward (input and weight gradients) through a part."""
    forward: float
    backward: float

    def __add__(self, other: PassTimes) -> PassTimes:
        return PassTimes(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, k: float) -> PassTimes:
        return PassTimes(self.forward * k, self.backward * k)


NOTHING = PassTimes(0.0, 0.0)


@dataclass(frozen=True)
class StageProfile:
    """Measured part times by micro-batch size: ``times[b][part]``."""
    name: str
    source: str
    times: dict[int, dict[str, PassTimes]]

    @staticmethod
    def holds(path: str) -> bool:
        """Whether the JSON file at ``path`` is a stage-cost profile (rather than a hardware profile)."""
        with open(path) as f:
            return KEY in json.load(f)

    @classmethod
    def load(cls, path: str) -> StageProfile:
        """The profile in the file; ValueError naming what is wrong with it."""
        with open(path) as f:
            data = json.load(f)
        try:
            times = {int(b): {part: PassTimes(*map(float, fb)) for part, fb in parts.items()}
                     for b, parts in data[KEY].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a stage-cost profile ({KEY}: {{micro-batch size: {{part: [forward s, backward s]}}}}"
                             f"): {e}") from None
        unknown = sorted({part for parts in times.values() for part in parts} - set(PARTS))
        if not times or unknown or any(t.forward < 0 or t.backward < 0 for p in times.values() for t in p.values()):
            raise ValueError(f"a stage-cost profile needs sizes with parts of {', '.join(PARTS)} and times >= 0"
                             f"{f' (unknown: {unknown})' if unknown else ''}")
        return cls(data.get("name", path), data.get("source", ""), times)

    def save(self, path: str) -> None:
        doc = {"name": self.name, "source": self.source,
               KEY: {str(b): {part: [t.forward, t.backward] for part, t in parts.items()}
                     for b, parts in sorted(self.times.items())}}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    def at(self, b: int) -> dict[str, PassTimes]:
        """The parts' times at micro-batch size ``b``: measured, or the nearest measured size's in proportion."""
        if b in self.times:
            return self.times[b]
        near = min(self.times, key=lambda m: (abs(m - b), m))
        return {part: t * (b / near) for part, t in self.times[near].items()}

    def stage(self, shape: ModelShape, held: Layout, stage: int, b: int) -> PassTimes:
        """One micro-batch through model stage ``stage`` of the layout, on one device holding it whole."""
        parts = self.at(b)
        dense, moe = stage_layers(shape, held, stage)
        st = held.stages[stage]
        return (parts.get("layer", NOTHING) * dense + parts.get("moe_layer", NOTHING) * moe
                + parts.get("output", NOTHING) * st.loss + parts.get("mtp", NOTHING) * st.mtp)

    def priced(self, shape: ModelShape, profile: Profile, depth: int, width: int, ep: int = 1,
               shards: int = 1) -> StageCosts:
        """The planner's stage costs from these times: each stage's parts over ``shards`` (tensor x context
        parallel ranks), its MoE layers' all-to-all and every other cost from the hardware profile."""
        def priced(v: int, held: Layout, b: int) -> CostModel:
            base = costs(shape, profile, depth, b, width, ep, v, held)
            a2a = all_to_all(shape, profile, b, ep)
            stages = range(len(held.stages))
            times = [self.stage(shape, held, s, b) * (1 / shards) for s in stages]
            moe = [stage_layers(shape, held, s)[1] + held.stages[s].mtp * shape.is_moe(shape.layers) for s in stages]
            return dataclasses.replace(base, forward=[t.forward + n * a2a for t, n in zip(times, moe)],
                                       backward=[t.backward + n * a2a for t, n in zip(times, moe)])
        return priced

    def describe(self, b: int) -> str:
        """One line of the parts' times at ``b`` in ms, forward/backward."""
        return ", ".join(f"{part} {1e3 * t.forward:.3g}/{1e3 * t.backward:.3g}" for part, t in self.at(b).items())
