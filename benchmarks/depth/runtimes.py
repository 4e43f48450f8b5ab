"""The three runtimes, each driving the same emulated stages for one iteration (forward and backward
of N micro-batches, no optimizer step): our executor, megatron-core's own schedules and
torch.distributed.pipelining's. A ``Case`` is built once per process and run many times; ``run()``
is one iteration on this rank. Its ``schedule`` is what the simulator replays for the prediction, its
``chosen`` the layout whose stage times its emulated stages wait.

Every message is an activation of ``Setup.seq`` rows of the hidden size (GPT-2 1.3B's 1280) in bf16:
the rows are what sizes a message to cost what the profile's interconnect says (``__main__``).

With ``Setup.a2a_fraction`` (``--a2a-fraction``) our executor's stages are MoE stages
(benchmarks/depth/moe.py) run as schedule plans, overlap on (the registry's "... overlap" variants)
and off alike, so the off control runs the very same parts one micro-batch at a time; an overlap
case runs at one ``contention`` (compute's slowdown beside an all-to-all), its schedule chosen at it.
A micro-batch is then two samples of half the rows (the same bytes per message), so that an action
can run as two halves of it. megatron-core's stages spend the all-to-all inside their passes
(``StageTimes.serial``): its 1F1B and interleaved schedules run a MoE layer's parts one after another.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import TransformerConfig
from torch.distributed import pipelining

from chimera_schedules import Schedule, build, build_spec, check, variant
from chimera_schedules.ir.channels import P2P_GROUPS, stage_group
from chimera_schedules.passes.lowering import lower
from chimera_schedules.registry import REGISTRY
from chimera_schedules.runtime.executor import make_forward_backward
from chimera_schedules.runtime.messages import Transport
from chimera_schedules.runtime.p2p import TorchP2P
from chimera_schedules.tools.planner import ModelShape, Profile

from .costs import cost_model, from_torch, stage_times
from .layouts import Chosen, even
from .moe import MoEStage
from .stage import EmulatedStage, forward_step, loss

SEQ, HIDDEN, LAYERS, HEADS = 632, 1280, 64, 20  # GPT-2 1.3B, micro-batch 1: the messages' default shape
DTYPE = torch.bfloat16
OVERLAP = " overlap"  # the registry's variants that overlap forward and backward: the plain name and this


def without_overlap(name: str) -> str:
    """The variant an overlap variant overlaps (the name itself for one that does not)."""
    return name.removesuffix(OVERLAP)


@dataclass
class Case:
    runtime: str  # "ours", "megatron-core" or "torch"
    schedule_name: str
    microbatches: int
    run: Callable[[], None]
    schedule: Schedule  # the order the simulator replays
    lowered: bool  # replay it as our executor posts it (lowered), or as compute only
    chosen: Chosen  # the layout its stages' times come from
    first_input_in_weight: bool = False  # costs.cost_model's option
    release: Callable[[], bool] = lambda: False  # drop what the case holds between rounds; True if it did
    contention: float = 0.0  # compute's slowdown beside an all-to-all (moe.CONTENTION while it runs)

    @property
    def overlap(self) -> bool:
        return self.schedule_name.endswith(OVERLAP)


@dataclass
class Setup:
    """What every case of one launch shares: depth, the model and profile its stage times come from,
    the messages' rows and what one costs, process groups."""
    depth: int
    forward_ms: float
    model: str  # a name in planner.MODELS, or a --model-flags file's
    profile: Profile
    shape: ModelShape  # the model's (benchmarks/depth/models.py)
    seq: int = SEQ  # rows of a message
    p2p_ms: float = 0.0
    timeout: timedelta = timedelta(minutes=5)
    groups: dict = field(default_factory=dict)  # name or frozenset of ranks -> process group
    a2a_fraction: float = 0.0  # of a MoE layer's forward compute, its all-to-all (0: none, no MoE stages)
    host_ms: float = 0.0  # what each part a MoE stage issues adds, or each pass of a plain one, measured at startup
    micro_batch_size: int = 1  # an odd one halves along each sequence, an even one along its sequences
    halves_efficiency: float = 1.0  # of the split it takes (costs.halves_efficiency_at)

    def times(self, virtual_stages: int, held=None):
        """Per model stage, its times under layout ``held`` (the even split by default)."""
        return stage_times(self.shape, self.depth, virtual_stages, self.forward_ms, self.profile, held,
                           self.a2a_fraction)

    def costs(self, virtual_stages: int, held=None, first_input_in_weight: bool = False, contention: float = 0.0):
        return cost_model(self.times(virtual_stages, held), self.p2p_ms, first_input_in_weight, contention,
                          self.host_ms, self.halves_efficiency)

    def config(self, virtual_stages: int = 1, combined: bool = False):
        """A megatron-core TransformerConfig with Megatron-LM's p2p defaults: batched p2p without
        virtual stages, overlapped p2p (--overlap-p2p-communication) with them. ``combined``: its
        combined 1F1B (--overlap-moe-expert-parallel-comm), under the rules its config checks (experts
        over an expert-parallel group, the alltoall dispatcher, bf16), which the emulated stages meet."""
        interleaved = virtual_stages > 1
        moe = {"num_moe_experts": 8, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall",
               "bf16": True, "overlap_moe_expert_parallel_comm": True, "add_bias_linear": False} if combined else {}
        return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                 pipeline_model_parallel_size=self.depth, pipeline_dtype=DTYPE,
                                 virtual_pipeline_model_parallel_size=virtual_stages if interleaved else None,
                                 deallocate_pipeline_outputs=True, overlap_p2p_comm=interleaved,
                                 batch_p2p_comm=not interleaved, **moe)

    def group(self, ranks) -> dist.ProcessGroup | None:
        """The group of ``ranks``, created beforehand by ``create_groups``; None for one rank."""
        return self.groups[frozenset(ranks)] if len(set(ranks)) > 1 else None

    def create_groups(self, schedules: list[Schedule]) -> None:
        """Every group our cases name, created by every rank in one order: the p2p channels and each
        model stage's replica group."""
        every = range(self.depth)
        for name in P2P_GROUPS:
            self.groups[name] = dist.new_group(list(every), timeout=self.timeout)
        replicas = {frozenset(row[s] for row in sch.placement) for sch in schedules
                    for s in range(sch.stages_per_pipeline)}
        for ranks in sorted((r for r in replicas if len(r) > 1), key=sorted):
            self.groups[ranks] = dist.new_group(sorted(ranks), timeout=self.timeout)


def sample(shape: tuple) -> torch.Tensor:
    """A first stage's input: one sample, already activation-shaped."""
    return torch.randn(shape).to(DTYPE)


def batch_first_sample(shape: tuple) -> torch.Tensor:
    """A first stage's input as a data loader gives it, samples first ([batch, rows, hidden]; the
    stage's forward step makes it [rows, batch, hidden]), so that a halved action can split it."""
    return sample(shape)


# ------------------------------------------------------------------------------------------- ours
class _ReplicaSum:
    """The GradSync protocol for the emulated stages: the copies of a stage sum their gradients with an
    asynchronous all-reduce, finished at the flush (what the trainer's ReplicaGradSync does with
    --overlap-grad-reduce, as Megatron-LM's recipes run; megatron-core's cases here hold one copy of each
    stage, so they have nothing to reduce)."""

    def __init__(self, chunks: dict):
        self.chunks, self.pending = chunks, []

    def start(self, pipeline: int, stage: int, group, channel: str) -> None:
        if group is None:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self.chunks[(pipeline, stage)].parameters()
                          if p.grad is not None])
        self.pending.append(dist.all_reduce(flat, group=group, async_op=True))

    def finish(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()


def ours_schedule(setup: Setup, name: str, n: int, contention: float = 0.0) -> Schedule:
    """The registry's variant, built at this run's costs (``--order best``, a split backward's W
    placement and the overlap pass's choices depend on them)."""
    spec = check(variant(name, setup.depth, n))
    return build_spec(spec, setup.costs(REGISTRY[spec.schedule].virtual_stages(spec), contention=contention))


def ours(setup: Setup, name: str, n: int, schedule: Schedule, chosen: Chosen, contention: float = 0.0) -> Case:
    lowered, worker = lower(schedule), dist.get_rank()
    times, scale = setup.times(schedule.virtual_stages, chosen.layout), schedule.microbatch_scale
    held = lowered.held(worker)
    config, moe = setup.config(), bool(setup.a2a_fraction)
    chunks = [(MoEStage if moe else EmulatedStage)(times[s].scaled(scale), config, first=s == 0) for _, s in held]
    groups = {name: setup.groups[name] for name in P2P_GROUPS}
    groups.update({stage_group(s): setup.group([row[s] for row in schedule.placement])
                   for s in range(schedule.stages_per_pipeline)})
    transport = Transport(worker, list(range(setup.depth)), groups, torch.device("cpu"), DTYPE,
                          TorchP2P(setup.timeout))
    step = make_forward_backward(lowered, transport, _ReplicaSum(dict(zip(held, chunks))), schedule_plans=moe)
    seq = max(1, round(setup.seq * scale))  # a half-size micro-batch of one sample: half the sequence
    batch = 2 if moe else 1  # MoE: two samples of half the rows, which a halved action splits
    rows = max(1, seq // batch)
    data = batch_first_sample((batch, rows, HIDDEN)) if moe else sample((seq, 1, HIDDEN))

    def run():
        step(forward_step_func=forward_step, data_iterator=[itertools.repeat(data) for _ in held], model=chunks,
             num_microbatches=lowered.microbatches, seq_length=rows, micro_batch_size=batch)
    return Case("ours", name, n, run, schedule, lowered=True, chosen=chosen, contention=contention)


# ---------------------------------------------------------------------------------- megatron-core
MEGATRON = {"1f1b": 1, "interleaved v=2": 2}  # schedule -> model chunks per rank
COMBINED = "combined 1f1b v=2"  # megatron-core's interleaved schedule with its combined 1F1B: with --a2a-fraction


def megatron_order(depth: int, n: int, name: str) -> Schedule:
    """megatron-core's compute order: our 1f1b's or interleaved's (its combined 1F1B's too, which our IR
    does not generate: the interleaved order, its pairs and extra warm-up forward left out)."""
    v = 2 if name == COMBINED else MEGATRON[name]
    return build("interleaved", depth, n, virtual_stages=v) if v > 1 else build("1f1b", depth, n)


def megatron(setup: Setup, name: str, n: int, chosen: Chosen) -> Case:
    """megatron-core's forward_backward_pipelining_without_interleaving (1F1B) or _with_interleaving:
    chunk c of rank r is model stage c x D + r. Its order is our 1f1b's or interleaved's. With the
    all-to-all, its stages spend it inside their passes, or, in its combined 1F1B (``COMBINED``), run
    as schedule plans on the communication thread, which its schedule pairs."""
    combined = name == COMBINED
    v, rank, d = 2 if combined else MEGATRON[name], dist.get_rank(), setup.depth
    times, config = setup.times(v, chosen.layout), setup.config(v, combined)
    if setup.a2a_fraction and not combined:
        times = [t.serial() for t in times]
    stage_type = MoEStage if combined else EmulatedStage
    chunks = [stage_type(times[c * d + rank], config, first=c * d + rank == 0) for c in range(v)]
    for c, chunk in enumerate(chunks):
        chunk.vp_stage, chunk.model_type = (c if v > 1 else None), ModelType.encoder_or_decoder
    func = (schedules.forward_backward_pipelining_with_interleaving if v > 1
            else schedules.forward_backward_pipelining_without_interleaving)
    data = batch_first_sample((1, setup.seq, HIDDEN)) if combined else sample((setup.seq, 1, HIDDEN))

    def run():
        func(forward_step_func=forward_step, data_iterator=[itertools.repeat(data) for _ in chunks], model=chunks,
             num_microbatches=n, seq_length=setup.seq, micro_batch_size=1)
    return Case("megatron-core", name, n, run, megatron_order(d, n, name), lowered=False, chosen=chosen)


# -------------------------------------------------------------------------------------------- torch
# schedule class -> (our name for it, model chunks per rank, placement: "loop" or "v")
TORCH = {"Schedule1F1B": ("1f1b", 1, "loop"), "ScheduleInterleaved1F1B": ("interleaved v=2", 2, "loop"),
         "ScheduleInterleavedZeroBubble": ("interleaved zero bubble v=2", 2, "loop"),
         "ScheduleZBVZeroBubble": ("zbv", 2, "v"), "ScheduleDualPipeV": ("dualpipev", 2, "v")}


def torch_placement(depth: int, chunks: int, style: str) -> list[int]:
    """The rank of each model stage: round-robin ("loop") or down and back ("v")."""
    if style == "v":
        return list(range(depth)) + list(reversed(range(depth)))
    return [s % depth for s in range(depth * chunks)]


def torch_pipelining(setup: Setup, cls_name: str, n: int) -> Case:
    """One of torch.distributed.pipelining's schedules over PipelineStages of the emulated modules;
    micro-batches are split from one batch along dim 0 (torch's convention: [1, sequence, hidden]).
    Its stages keep a receive buffer per micro-batch once they have run, so the case is released
    after each round and built again (and warmed up again) in the next: at D=16, N=64 every torch
    case held at once would not fit in this machine's memory. It runs at the even layout only: its
    order, which a layout search would price, exists only once its stages are built on every rank,
    after the layouts are decided."""
    name, v, style = TORCH[cls_name]
    d, rank = setup.depth, dist.get_rank()
    placement = torch_placement(d, v, style)
    mine = [s for s, r in enumerate(placement) if r == rank]
    chosen = even(setup, v)
    times, config = setup.times(v, chosen.layout), setup.config()

    def make():
        stages = [pipelining.PipelineStage(EmulatedStage(times[s], config, first=s == 0), s, d * v,
                                           torch.device("cpu")) for s in mine]
        return getattr(pipelining, cls_name)(stages if v > 1 else stages[0], n, loss_fn=loss)

    held = [make()]  # constructing one allocates nothing yet; its order is the prediction's
    target = torch.zeros(n) if d * v - 1 in mine else None

    def run():
        if not held:
            held.append(make())
        if len(held) == 1:  # the first stage's batch of N samples, held as long as the case
            held.append((sample((n, setup.seq, HIDDEN)),) if 0 in mine else ())
        held[0].step(*held[1], target=target, return_outputs=False)

    def release() -> bool:
        held.clear()
        return True
    order = (from_torch(name, d, n, placement, held[0].pipeline_order) if v > 1 else build("1f1b", d, n))
    return Case("torch", name, n, run, order, lowered=False, chosen=chosen, first_input_in_weight=True,
                release=release)
