"""The performance model and layout planner (the paper's configuration selection).

Given P workers, a global batch, a GPT shape and a hardware profile, enumerate layouts -- depth D,
data-parallel width W = P / D, micro-batch size B, micro-batches N = global batch / (W B), schedule
and concatenation -- predict each one's iteration time with the simulator, drop those that do not fit
in memory, and rank the rest: ``plan(workers, global_batch, shape, profile)``, printed by ``explain``
and ``python -m chimera_schedules plan``.

Costs are Megatron's FLOP count at the profile's rate, p2p at its latency and bandwidth, and each
stage's gradient all-reduce posted by the schedule's R actions; memory is the model state of the stage
copies a worker holds (``model_state_bytes``) plus the simulator's peak of live micro-batches'
activations, or what the optimizer step allocates after the flush (``step_bytes``) where that is more.
The formulas, and what experts add (``ModelShape.experts``): docs/notes/planner-model.md.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..analysis.simulator import peak_activations, simulate
from ..ir import layout
from ..ir.costs import CostModel, halves_efficiency_at
from ..ir.errors import ConfigError
from ..ir.layout import Layout
from ..registry import REGISTRY, VARIANTS, build_spec, variant


@dataclass(frozen=True)
class Experts:
    """The MoE layers' MLP: ``count`` experts of width ``ffn``, ``topk`` routed per token, a shared
    expert of width ``shared_ffn`` (0: none). The last ``moe_layers`` layers are MoE (DeepSeek's first
    layers are dense)."""
    count: int
    topk: int
    ffn: int
    moe_layers: int
    shared_ffn: int = 0


@dataclass(frozen=True)
class ModelShape:
    """A GPT: dense layers of MLP width ``ffn`` (None: 4h, the original GPT formulas), SwiGLU's three
    MLP matrices when ``gated``, and with ``experts`` some layers mixture-of-experts."""
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int | None = None
    gated: bool = False
    experts: Experts | None = None
    stores_attention_scores: bool = True  # False: flash attention, no 5 a s / h term in the activations
    mtp: int = 0  # multi-token-prediction layers (DeepSeek-V3's), after the last layer

    @property
    def params_per_layer(self) -> int:
        """A dense layer's."""
        return 4 * self.hidden ** 2 + 13 * self.hidden + self._matrices * self.hidden * self._ffn

    @property
    def embedding_params(self) -> int:
        return (self.vocab + self.seq) * self.hidden

    def layer_forward_flops(self, b: int) -> float:
        """A dense layer's: attention 8 b s h^2 + 4 b s^2 h, MLP 2 b s h x its matrices' widths."""
        return self._attention_flops(b) + 2 * b * self.seq * self.hidden * self._matrices * self._ffn

    def layer_activation_bytes(self, b: int, element: int = 2) -> float:
        """What one micro-batch leaves in a dense layer for its backward, with activations of ``element`` bytes
        (2: bf16 or fp16, 4: fp32): Korthikanti et al.'s s b h (34 + 5 a s / h) in half precision, 16 values
        and 2 one-byte dropout masks per s b h, 2 values and a mask per attention score."""
        return self.seq * b * self.hidden * (16 * element + 2 + self._scores(element))

    def _scores(self, element: int) -> float:
        return (2 * element + 1) * self.heads * self.seq / self.hidden if self.stores_attention_scores else 0.0

    @property
    def _ffn(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def _matrices(self) -> int:
        return 3 if self.gated else 2

    def _attention_flops(self, b: int) -> float:
        return 8 * b * self.seq * self.hidden ** 2 + 4 * b * self.seq ** 2 * self.hidden

    def is_moe(self, layer: int) -> bool:
        """Layers past the model's (MTP layers) are shaped like its last one."""
        return self.experts is not None and layer >= self.layers - self.experts.moe_layers

    def logits_flops(self, b: int) -> float:
        """The output layer's forward (the loss's softmax is negligible beside it)."""
        return 2 * b * self.seq * self.hidden * self.vocab

    def mtp_layer_forward_flops(self, b: int) -> float:
        """One MTP depth (megatron-core's): the projection of [hidden; embedded next token] (2h -> h), a
        transformer layer shaped like the model's last, and its own pass through the output layer."""
        last = self.moe_layer_forward_flops(b) if self.is_moe(self.layers) else self.layer_forward_flops(b)
        return 2 * b * self.seq * 2 * self.hidden * self.hidden + last + self.logits_flops(b)

    def moe_layer_forward_flops(self, b: int) -> float:
        e = self.experts
        width = e.topk * e.ffn + e.shared_ffn
        mlp = 2 * b * self.seq * self.hidden * (self._matrices * width + e.count)  # experts and router
        return self._attention_flops(b) + mlp

    def moe_layer_params(self, expert_parallel: int) -> tuple[float, float]:
        """(params every rank of the stage holds, routed-expert params of one expert-parallel rank)."""
        e, mats = self.experts, self._matrices
        dense = 4 * self.hidden ** 2 + 2 * self.hidden + self.hidden * e.count + mats * self.hidden * e.shared_ffn
        return dense, e.count // expert_parallel * mats * self.hidden * e.ffn

    def moe_layer_activation_bytes(self, b: int, element: int = 2) -> float:
        e = self.experts
        mlp = 19 * (e.topk * e.ffn + e.shared_ffn) / (4 * self.hidden)
        return self.seq * b * self.hidden * ((15 + mlp) * element / 2 + self._scores(element))


# The Chimera paper's GPT-2 (64 layers, 1.3B parameters, sequence 632): the projections' and the depth
# benchmark's model.
GPT2_1_3B = ModelShape(layers=64, hidden=1280, heads=20, seq=632, vocab=50257)
# The shapes people train now, for the balancer and the depth benchmark: Llama 3 8B (SwiGLU, a
# 128,256-token vocabulary, flash attention) and DeepSeek-V3 (61 layers, the first 3 dense, then 256
# routed experts top-8 with a shared one, a 129,280-token vocabulary, one MTP layer).
LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, seq=8192, vocab=128256, ffn=14336, gated=True,
                       stores_attention_scores=False)
DEEPSEEK_V3 = ModelShape(layers=61, hidden=7168, heads=128, seq=4096, vocab=129280, ffn=18432, gated=True,
                         experts=Experts(count=256, topk=8, ffn=2048, moe_layers=58, shared_ffn=2048),
                         stores_attention_scores=False, mtp=1)
MODELS = {"gpt2-1.3b": GPT2_1_3B, "llama3-8b": LLAMA3_8B, "deepseek-v3": DEEPSEEK_V3}


@dataclass(frozen=True)
class Profile:
    """Hardware, from a JSON file: sustained FLOP/s, p2p and all-reduce latency (s) and bandwidth (B/s),
    memory per device (bytes). ``source`` says where the numbers come from. ``halves_efficiency`` and
    ``sequence_halves_efficiency``: how fast a half of a micro-batch's sequences and a half of each sequence
    compute for their size, as gpu_check's layer profile measures them; 1.0 where not given."""

    name: str
    flops: float
    p2p_latency: float
    p2p_bandwidth: float
    allreduce_latency: float
    allreduce_bandwidth: float
    memory: float
    source: str = ""
    halves_efficiency: float = 1.0
    sequence_halves_efficiency: float = 1.0

    @classmethod
    def load(cls, path: str) -> Profile:
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Precision:
    """The training flags that set the model state: --bf16 (or --fp16) and --use-distributed-optimizer;
    whether AdamW steps with one fused kernel (the trainer's on a GPU, megatron/chimera/optim/adam.py)
    or with torch's foreach default, which allocates at the step (``step_bytes``); and --optimizer muon,
    whose Muon keeps one fp32 momentum per hidden weight matrix element (megatron/chimera/optim/muon.py)."""
    half: bool = False
    distributed_optimizer: bool = False
    fused_adam: bool = True
    muon: bool = False


def model_state_bytes(params: float, copies: int, replicas: int, precision: Precision = Precision(),
                      matrices: float = 0.0) -> dict:
    """One worker's model state in bytes, as megatron/chimera/observability/startup.py counts it from the tensors:
    ``copies`` stage copies of ``params`` parameters each; weights in bf16 (2 bytes) or fp32 (4); fp32
    main weights only when the weights are bf16; an fp32 gradient per parameter; AdamW's two fp32
    moments, or with --optimizer muon Muon's one fp32 momentum for the ``matrices`` of the ``params`` it
    steps. The distributed optimizer divides main weights and moments over the stage's replica group
    (``replicas``: pipelines x data-parallel width); Muon's layer-wise one the moments only (every rank keeps
    every main weight, the owners' broadcast after the step). fp32 without it: 16 bytes per parameter."""
    shard = replicas if precision.distributed_optimizer else 1
    muon = matrices / params if precision.muon and params else 0.0
    main = (4 if precision.half else 0) / (1 if precision.muon else shard)
    per_copy = {"parameters": 2 if precision.half else 4, "main parameters": main,
                "gradients": 4, "optimizer": (8 - 4 * muon) / shard}
    out = {k: copies * params * v for k, v in per_copy.items()}
    return {**out, "total": sum(out.values())}


def step_bytes(params: float, replicas: int, precision: Precision = Precision()) -> float:
    """What the optimizer step of ``params`` parameters that AdamW steps allocates beyond the model state, in
    bytes. torch's foreach AdamW holds sqrt(exp_avg_sq) of a whole parameter group at once: 4 bytes per main
    parameter (the largest group's, nearly all of them: counted as all), sharded like the moments. A fused
    kernel (torch's fused=True, Transformer Engine's or apex's FusedAdam) allocates nothing. (Muon's
    Newton-Schulz holds a few copies of one matrix at a time: not counted.)"""
    shard = replicas if precision.distributed_optimizer else 1
    return 0.0 if precision.fused_adam else 4 * params / shard


@dataclass
class Candidate:
    schedule: str  # a name in registry.VARIANTS
    depth: int
    width: int
    micro_batch: int
    microbatches: int
    expert_parallel: int = 1
    seconds: float = 0.0
    bubble_ratio: float = 0.0
    memory: float = 0.0
    fits: bool = True
    tokens_per_s: float = 0.0

    @property
    def label(self) -> str:
        ep = f" EP={self.expert_parallel}" if self.expert_parallel > 1 else ""
        return f"{self.schedule} D={self.depth} W={self.width}{ep} B={self.micro_batch} N={self.microbatches}"


PLANNED = ("gpipe", "1f1b", "chimera direct", "chimera doubling", "1f1b split", "chimera split",
           "dualpipe")  # names in registry.VARIANTS


def family(name: str) -> str:
    """What a variant is compared as: its schedule, with " split" for a split backward."""
    v = VARIANTS[name]
    return v["schedule"] + (" split" if v.get("split_backward") else "")


def stage_layers(shape: ModelShape, layout: Layout, stage: int) -> tuple[int, int]:
    """(dense, MoE) transformer layers of model stage ``stage`` of the layout."""
    first = layout.first_layer(stage)
    moe = sum(shape.is_moe(i) for i in range(first, first + layout.stages[stage].layers))
    return layout.stages[stage].layers - moe, moe


def all_to_all(shape: ModelShape, profile: Profile, b: int, ep: int) -> float:
    """One MoE layer's dispatch and combine in one direction of the pass."""
    if ep <= 1:
        return 0.0
    leaving = b * shape.seq * shape.hidden * 2 * shape.experts.topk * (ep - 1) / ep  # bf16 hidden states
    return 2 * (profile.p2p_latency + leaving / profile.p2p_bandwidth)


def even_layout(shape: ModelShape, stages: int) -> Layout:
    return layout.even(shape.layers, stages, shape.mtp)


def stage_forward(shape: ModelShape, profile: Profile, held: Layout, stage: int, b: int, ep: int = 1) -> float:
    """Seconds of one micro-batch's forward through model stage ``stage``: its layers, its MTP layers
    and its output layer (the embedding's lookup is negligible; its weights count in memory)."""
    dense, moe = stage_layers(shape, held, stage)
    st = held.stages[stage]
    flops = dense * shape.layer_forward_flops(b) + (moe * shape.moe_layer_forward_flops(b) if moe else 0)
    flops += st.mtp * shape.mtp_layer_forward_flops(b) + st.loss * shape.logits_flops(b)
    moe_layers = moe + (st.mtp if shape.is_moe(shape.layers) else 0)
    return flops / profile.flops + (moe_layers * all_to_all(shape, profile, b, ep) if moe_layers else 0)


def costs(shape: ModelShape, profile: Profile, depth: int, b: int, width: int, ep: int = 1,
          virtual_stages: int = 1, held: Layout | None = None) -> CostModel:
    """Per model stage (``depth`` x ``virtual_stages`` of them, split as ``held`` says, evenly by
    default): its forward time, and the gradient bytes one worker all-reduces per stage copy."""
    held = held or even_layout(shape, depth * virtual_stages)
    stages = range(len(held.stages))
    forward = [stage_forward(shape, profile, held, s, b, ep) for s in stages]
    grad_bytes = max(2 * virtual_stages * _stage_params(shape, held, s, ep)[0] for s in stages)  # fp16
    return CostModel(forward=forward, backward=[2 * f for f in forward], p2p_latency=profile.p2p_latency,
                     p2p_bandwidth=profile.p2p_bandwidth, activation_bytes=b * shape.seq * shape.hidden * 2,
                     allreduce_latency=profile.allreduce_latency, allreduce_bandwidth=profile.allreduce_bandwidth,
                     grad_bytes=grad_bytes, data_parallel=width,
                     halves_efficiency=halves_efficiency_at(b, profile.halves_efficiency,
                                                            profile.sequence_halves_efficiency))


def _stage_matrices(shape: ModelShape, held: Layout, stage: int, ep: int) -> float:
    """The parameters of the model stage, routed experts aside, that Muon steps (megatron-core's rule: 2-D,
    not the word embedding or output layer): all but the vocabulary matrices and the layers' norms and
    biases (13 h in a dense GPT layer, the two norms' 2 h in an MoE layer)."""
    params, experts = _stage_params(shape, held, stage, ep)
    dense, moe = stage_layers(shape, held, stage)
    st = held.stages[stage]
    mtp_moe = shape.is_moe(shape.layers)
    vectors = shape.hidden * (13 * (dense + st.mtp * (not mtp_moe)) + 2 * (moe + st.mtp * mtp_moe))
    return params - experts - vectors - shape.hidden * shape.vocab * (st.embedding + st.loss + bool(st.mtp))


def _stage_params(shape: ModelShape, held: Layout, stage: int, ep: int) -> tuple[float, float]:
    """(all parameters a rank holds of the model stage, the routed experts' among them): its layers,
    its MTP layers (a layer shaped like the last, plus the 2h -> h projection) and a copy of the
    vocabulary matrix for each of the embedding, the output layer and MTP's embedding."""
    dense, moe = stage_layers(shape, held, stage)
    st = held.stages[stage]
    mtp_moe = shape.is_moe(shape.layers)
    shared, experts = shape.moe_layer_params(ep) if shape.experts else (0, 0)
    total = dense * shape.params_per_layer + moe * (shared + experts)
    total += st.mtp * ((shared + experts if mtp_moe else shape.params_per_layer) + 2 * shape.hidden ** 2)
    total += shape.hidden * shape.vocab * (st.embedding + st.loss + bool(st.mtp))
    return total, (moe + st.mtp * mtp_moe) * experts


def stage_activation_bytes(shape: ModelShape, held: Layout, stage: int, b: int, element: int = 2) -> float:
    """Activations one micro-batch leaves in model stage ``stage`` until its backward, its layers' of
    ``element`` bytes (2 in half precision, 4 in fp32)."""
    dense, moe = stage_layers(shape, held, stage)
    st = held.stages[stage]
    per_moe = shape.moe_layer_activation_bytes(b, element) if shape.experts else 0
    mtp = st.mtp * (per_moe if shape.is_moe(shape.layers) else shape.layer_activation_bytes(b, element))
    logits = (st.loss + st.mtp) * 4 * b * shape.seq * shape.vocab  # fp32 logits kept for the loss
    return dense * shape.layer_activation_bytes(b, element) + moe * per_moe + mtp + logits


def worker_memory(shape: ModelShape, schedule, held: Layout, b: int, width: int, ep: int = 1,
                  precision: Precision = Precision(), cp: int = 1) -> float:
    """The largest worker's bytes: the model state of the stage copies it holds (routed experts sharded
    over their expert-data-parallel ranks), plus the most activation bytes it keeps alive at once during
    the flush or, after it, what the optimizer step allocates (``step_bytes``), whichever is more. With
    context parallelism (``cp``) each rank keeps 1/cp of every micro-batch's activations (its part of the
    sequence: the attention scores too, its queries' rows) and a copy's replicas are DP x CP."""
    replicas, scale = schedule.pipelines * width * cp, schedule.microbatch_scale / cp
    element = 2 if precision.half else 4
    stage_bytes = [scale * stage_activation_bytes(shape, held, s, b, element) for s in range(len(held.stages))]
    live = peak_activations(schedule, stage_bytes)
    most = 0.0
    for worker, act in enumerate(live):
        state = step = 0.0
        for s in (s for row in schedule.placement for s, w in enumerate(row) if w == worker):
            params, experts = _stage_params(shape, held, s, ep)
            matrices = _stage_matrices(shape, held, s, ep) if precision.muon else 0.0
            for count, muon, group in ((params - experts, matrices, replicas),
                                       (experts, experts if precision.muon else 0.0, replicas // ep)):
                state += model_state_bytes(count, 1, group, precision, muon)["total"]
                step += step_bytes(count - muon, group, precision)
        most = max(most, state + max(act, step))
    return most


# What a caller prices a candidate at instead of the FLOP count (the depth benchmark: its emulated stages' times):
# (virtual stages per worker, layout, micro-batch size) -> costs
StageCosts = Callable[[int, Layout, int], CostModel]


def virtual_stages(name: str, depth: int, microbatches: int) -> int:
    """Model stages per worker and pipeline of the named variant, known before it is built."""
    return REGISTRY[VARIANTS[name]["schedule"]].virtual_stages(variant(name, depth, microbatches))


def evaluate(shape: ModelShape, profile: Profile, global_batch: int, c: Candidate,
             precision: Precision = Precision(), priced: StageCosts | None = None) -> Candidate:
    """The candidate's predicted iteration, bubble and memory; its schedule built at the same costs (an
    overlapped order's pairs, a split backward's W placement depend on them)."""
    ep, v = c.expert_parallel, virtual_stages(c.schedule, c.depth, c.microbatches)
    held = even_layout(shape, c.depth * v)
    model = priced(v, held, c.micro_batch) if priced else costs(shape, profile, c.depth, c.micro_batch, c.width, ep, v)
    schedule = build_spec(variant(c.schedule, c.depth, c.microbatches), model)
    result = simulate(schedule, model)
    c.memory = worker_memory(shape, schedule, held, c.micro_batch, c.width, ep, precision)
    c.seconds, c.bubble_ratio = result.makespan, result.bubble_ratio
    c.fits = c.memory <= profile.memory
    c.tokens_per_s = global_batch * shape.seq / c.seconds
    return c


def candidates(workers: int, global_batch: int, shape: ModelShape, depths=None, micro_batches=(1, 2, 4, 8),
               schedules=PLANNED, expert_parallel=(1,)):
    """Every layout the sizes allow; a schedule's own rules (even D for Chimera, N a multiple of D ...)
    are left to the schedule library, which ``plan`` asks. Expert parallelism divides the data-parallel
    width and the experts."""
    for d in depths or [d for d in range(2, workers + 1) if workers % d == 0]:
        if workers % d:  # uneven layer counts split as planner.even_layout does
            continue
        w = workers // d
        for ep in expert_parallel:
            if w % ep or (shape.experts and shape.experts.count % ep):
                continue
            for b in micro_batches:
                if global_batch % (w * b):
                    continue
                for name in schedules:
                    yield Candidate(name, d, w, b, global_batch // (w * b), ep)


def plan(workers: int, global_batch: int, shape: ModelShape, profile: Profile, depths=None,
         micro_batches=(1, 2, 4, 8), precision: Precision = Precision(), schedules=PLANNED,
         expert_parallel=(1,), priced: StageCosts | None = None) -> list[Candidate]:
    """All layouts, fastest first; those that do not fit in memory last."""
    ranked = []
    for c in candidates(workers, global_batch, shape, depths, micro_batches, schedules, expert_parallel):
        try:
            ranked.append(evaluate(shape, profile, global_batch, c, precision, priced))
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
