"""The performance model and layout planner (the paper's configuration selection).

Given P workers, a global batch, a GPT shape and a hardware profile, enumerate layouts -- depth D,
data-parallel width W = P / D, micro-batch size B, micro-batches N = global batch / (W B), schedule
and concatenation -- predict each one's iteration time with the simulator, drop those that do not fit
in memory, and rank the rest.

Costs (per worker, per micro-batch):
- compute: Megatron's count, 24 B s h^2 (1 + s / 6h) FLOPs per layer forward plus 2 B s h V for the
  logits on the last stage, at the profile's sustained FLOP/s; backward = 2 x forward;
- p2p: latency + B s h x 2 bytes / bandwidth between stages;
- gradient all-reduce per stage: Rabenseifner, 2 log2(r) alpha + 2 (r-1)/r beta L over r = copies x W
  (copies = 2 for Chimera), posted by the schedule's R actions, so the simulator overlaps it exactly
  as far as the schedule allows.
Memory: the model state of the stage copies a worker holds (``model_state_bytes``, the formula the
training program's startup line measures), plus activations: s B h (34 + 5 a s / h) bytes per layer
per micro-batch (Korthikanti et al.), times the simulator's peak of live micro-batches.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..analysis.simulator import simulate
from ..ir.costs import CostModel
from ..ir.errors import ConfigError
from ..registry import VARIANTS, build_spec, variant


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    @property
    def params_per_layer(self) -> int:
        return 12 * self.hidden ** 2 + 13 * self.hidden

    @property
    def embedding_params(self) -> int:
        return (self.vocab + self.seq) * self.hidden

    def layer_forward_flops(self, b: int) -> float:
        return 24 * b * self.seq * self.hidden ** 2 * (1 + self.seq / (6 * self.hidden))

    def layer_activation_bytes(self, b: int) -> float:
        return self.seq * b * self.hidden * (34 + 5 * self.heads * self.seq / self.hidden)


@dataclass(frozen=True)
class Profile:
    """Hardware, from a JSON file: sustained FLOP/s, p2p and all-reduce latency (s) and bandwidth (B/s),
    memory per device (bytes). ``source`` says where the numbers come from."""

    name: str
    flops: float
    p2p_latency: float
    p2p_bandwidth: float
    allreduce_latency: float
    allreduce_bandwidth: float
    memory: float
    source: str = ""

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Precision:
    """The training flags that set the model state: --bf16 (or --fp16) and --use-distributed-optimizer."""
    half: bool = False
    distributed_optimizer: bool = False


def model_state_bytes(params: float, copies: int, replicas: int, precision: Precision = Precision()) -> dict:
    """One worker's model state in bytes, as megatron/chimera/observability/startup.py counts it from the tensors:
    ``copies`` stage copies of ``params`` parameters each; weights in bf16 (2 bytes) or fp32 (4); fp32
    main weights only when the weights are bf16; an fp32 gradient per parameter; AdamW's two fp32
    moments. The distributed optimizer divides main weights and moments over the stage's replica group
    (``replicas``: pipelines x data-parallel width). fp32 without it: 16 bytes per parameter."""
    shard = replicas if precision.distributed_optimizer else 1
    per_copy = {"parameters": 2 if precision.half else 4, "main parameters": (4 if precision.half else 0) / shard,
                "gradients": 4, "optimizer": 8 / shard}
    out = {k: copies * params * v for k, v in per_copy.items()}
    return {**out, "total": sum(out.values())}


@dataclass
class Candidate:
    schedule: str  # a name in registry.VARIANTS
    depth: int
    width: int
    micro_batch: int
    microbatches: int
    seconds: float = 0.0
    bubble_ratio: float = 0.0
    memory: float = 0.0
    fits: bool = True
    tokens_per_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.schedule} D={self.depth} W={self.width} B={self.micro_batch} N={self.microbatches}"


PLANNED = ("gpipe", "1f1b", "chimera direct", "chimera doubling", "1f1b split", "chimera split",
           "dualpipe")  # names in registry.VARIANTS


def family(name: str) -> str:
    """What a variant is compared as: its schedule, with " split" for a split backward."""
    v = VARIANTS[name]
    return v["schedule"] + (" split" if v.get("split_backward") else "")


def costs(shape: ModelShape, profile: Profile, depth: int, b: int, width: int) -> CostModel:
    per_stage = shape.layers // depth
    forward = [per_stage * shape.layer_forward_flops(b) / profile.flops for _ in range(depth)]
    forward[-1] += 2 * b * shape.seq * shape.hidden * shape.vocab / profile.flops
    grad_bytes = per_stage * shape.params_per_layer * 2  # fp16 gradients of one stage
    return CostModel(forward=forward, backward=[2 * f for f in forward], p2p_latency=profile.p2p_latency,
                     p2p_bandwidth=profile.p2p_bandwidth, activation_bytes=b * shape.seq * shape.hidden * 2,
                     allreduce_latency=profile.allreduce_latency, allreduce_bandwidth=profile.allreduce_bandwidth,
                     grad_bytes=grad_bytes, data_parallel=width)


def evaluate(shape: ModelShape, profile: Profile, global_batch: int, c: Candidate,
             precision: Precision = Precision()) -> Candidate:
    model = costs(shape, profile, c.depth, c.micro_batch, c.width)
    schedule = build_spec(variant(c.schedule, c.depth, c.microbatches))
    result = simulate(schedule, model)
    per_stage = shape.layers // c.depth
    params = per_stage * shape.params_per_layer + shape.embedding_params / c.depth
    state = model_state_bytes(params, max(result.stage_copies), schedule.pipelines * c.width, precision)
    act = max(result.peak_activations) * per_stage * shape.layer_activation_bytes(c.micro_batch)
    c.seconds, c.bubble_ratio = result.makespan, result.bubble_ratio
    c.memory = state["total"] + act
    c.fits = c.memory <= profile.memory
    c.tokens_per_s = global_batch * shape.seq / c.seconds
    return c


def candidates(workers: int, global_batch: int, shape: ModelShape, depths=None, micro_batches=(1, 2, 4, 8)):
    """Every layout the sizes allow; a schedule's own rules (even D for Chimera, N a multiple of D ...)
    are left to the schedule library, which ``plan`` asks."""
    for d in depths or [d for d in range(2, workers + 1) if workers % d == 0]:
        if shape.layers % d or workers % d:
            continue
        w = workers // d
        for b in micro_batches:
            if global_batch % (w * b):
                continue
            n = global_batch // (w * b)
            for name in PLANNED:
                yield Candidate(name, d, w, b, n)


def plan(workers: int, global_batch: int, shape: ModelShape, profile: Profile, depths=None,
         micro_batches=(1, 2, 4, 8), precision: Precision = Precision()) -> list[Candidate]:
    """All layouts, fastest first; those that do not fit in memory last."""
    ranked = []
    for c in candidates(workers, global_batch, shape, depths, micro_batches):
        try:
            ranked.append(evaluate(shape, profile, global_batch, c, precision))
        except ConfigError:
            continue  # the schedule's rules exclude this layout
    return sorted(ranked, key=lambda c: (not c.fits, c.seconds))


def best_per_schedule(ranked: list[Candidate]) -> dict[str, Candidate]:
    out: dict[str, Candidate] = {}
    for c in ranked:
        if c.fits:
            out.setdefault(family(c.schedule), c)
    return out


def explain(ranked: list[Candidate], profile: Profile) -> str:
    fitting = [c for c in ranked if c.fits]
    if not fitting:
        smallest = min(ranked, key=lambda c: c.memory)
        return (f"no layout fits in {profile.memory / 2**30:.1f} GiB; the smallest needs "
                f"{smallest.memory / 2**30:.1f} GiB ({smallest.label})")
    best = fitting[0]
    lines = [f"pick: {best.label}: {best.seconds:.3f} s/iteration, {best.tokens_per_s:,.0f} tokens/s, "
             f"bubbles {best.bubble_ratio:.1%}, {best.memory / 2**30:.1f} of {profile.memory / 2**30:.1f} GiB"]
    for name, other in best_per_schedule(ranked).items():
        if other is not best:
            lines.append(f"  best {name}: {other.label}: {other.seconds:.3f} s "
                         f"({other.seconds / best.seconds:.2f}x the pick's time)")
    rejected = sum(1 for c in ranked if not c.fits)
    lines.append(f"  {len(ranked)} layouts considered, {rejected} rejected for memory; profile {profile.name}")
    return "\n".join(lines)


def as_json(ranked: list[Candidate]) -> list[dict]:
    return [{**asdict(c), "label": c.label} for c in ranked]
