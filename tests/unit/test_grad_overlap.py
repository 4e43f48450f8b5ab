"""When gradient reductions start (Megatron-LM's --overlap-grad-reduce) and the end of an iteration's
memory: one process, the collectives recorded by a stand-in runtime."""
from types import SimpleNamespace

import pytest
import torch

from megatron.chimera.model.parameter_names import TIED_NAME
from megatron.chimera.optim.distributed_optimizer import ShardedMainParams
from megatron.chimera.optim.gradients import ReplicaGradSync, clip_, weighted_square_sum
from megatron.chimera.optim.precision import MainParams


class _Done:
    def wait(self):
        pass


class _Runtime:
    """What the GradSyncs ask of the runtime; every collective is recorded, with what it was given."""

    def __init__(self, stages=(0,), embedding_group=None, experts=False):
        self.device, self.dp, self.tp, self.replicas = torch.device("cpu"), 1, 1, 1
        self.stage_groups = {s: f"stage {s}" for s in stages}
        self.expert_groups = {s: f"experts {s}" for s in stages} if experts else {}
        self.embedding_group, self.calls = embedding_group, []

    def all_reduce(self, tensor, group=None, async_op=False):
        self.calls.append((group, tensor, tensor.clone()))
        return _Done()

    def reduce_scatter(self, shard, flat, group):
        self.calls.append((group, flat, flat.clone()))
        return _Done()

    def optimizer_groups(self, group):
        return group, None, True  # one optimizer instance


def _chunk(stage: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(stage)
    chunk = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).to(dtype)
    chunk.stage, chunk.config = stage, SimpleNamespace(gradient_accumulation_fusion=False)
    for p in chunk.parameters():
        p.global_name, p.tensor_model_parallel = f"stage{stage}.{id(p)}", True
    return chunk


def _backward(chunk, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(3, 4, dtype=next(chunk.parameters()).dtype)
    chunk(x).float().sum().backward()


@pytest.fixture(autouse=True)
def _one_member_groups(monkeypatch):
    """The stand-in groups are names: the distributed optimizer sizes its shards as this rank's alone."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)


def _sync(kind: str, chunks: dict, rt):
    if kind == "replica":
        return ReplicaGradSync(MainParams(chunks, rt, tied=False).by_chunk, rt, overlap=True)
    return ShardedMainParams(chunks, rt, tied=False, overlap_reduce=True)


@pytest.mark.parametrize("kind, dtype", [("replica", torch.float32), ("replica", torch.bfloat16),
                                         ("sharded", torch.float32), ("sharded", torch.bfloat16)])
def test_megatron_core_hooks_start_a_chunk_when_its_last_backward_is_done(kind, dtype):
    """megatron-core's contract: backwards inside no_sync start nothing; in the last one, outside it, the
    chunk's bucket starts once every parameter's gradient is in it (after the fp16/bf16 hook has added
    it), and finish does not start it again."""
    rt, chunk = _Runtime(), _chunk(0, dtype)
    sync = _sync(kind, {(0, 0): chunk}, rt)
    hooks, = sync.chunk_syncs([chunk])
    with hooks.no_sync():
        _backward(chunk, 1)
    assert rt.calls == []
    _backward(chunk, 2)
    (group, buffer, at_start), = rt.calls
    assert group == "stage 0" and torch.equal(at_start, buffer)  # nothing was added after it started
    assert at_start.abs().sum() > 0
    sync.finish()
    assert len(rt.calls) == 1
    hooks.start_grad_sync()  # a new iteration: the interleaved schedule's call starts it again
    assert len(rt.calls) == 2


@pytest.mark.parametrize("kind", ["replica", "sharded"])
def test_without_overlap_every_reduction_starts_after_the_schedule_in_stage_order(kind):
    """Megatron-LM's default: an R action records nothing; finish starts every copy, stage by stage."""
    rt = _Runtime(stages=(0, 1))
    chunks = {(0, 1): _chunk(1), (1, 0): _chunk(0)}  # Chimera's placement order on a worker
    sync = ReplicaGradSync(MainParams(chunks, rt, tied=False).by_chunk, rt) if kind == "replica" else ShardedMainParams(
        chunks, rt, tied=False)
    assert sync.chunk_syncs(list(chunks.values())) is None
    sync.start(0, 1, "stage 1", "stage1")
    sync.start(1, 0, "stage 0", "stage0")
    assert rt.calls == []
    sync.finish()
    assert [group for group, _, _ in rt.calls] == ["stage 0", "stage 1"]


def test_with_overlap_an_r_action_starts_its_reduction_at_once():
    rt = _Runtime()
    sync = ReplicaGradSync(MainParams({(0, 0): _chunk(0)}, rt, tied=False).by_chunk, rt, overlap=True)
    sync.start(0, 0, "stage 0", "stage0")
    assert len(rt.calls) == 1
    sync.finish()
    assert len(rt.calls) == 1


def _moe_chunk(stage: int) -> torch.nn.Module:
    """A chunk whose first weight is a routed expert's and whose last is the tied word embedding."""
    chunk = _chunk(stage)
    chunk[0].weight.allreduce = False
    chunk[1].weight.global_name = TIED_NAME
    return chunk


def _chimera_worker(kind: str, overlap: bool):
    """Worker 0 of Chimera D=2 (stage 1 of pipeline 0, stage 0 of pipeline 1), experts and a tied
    embedding on both stages, both copies' backwards done; its GradSync and runtime."""
    rt = _Runtime(stages=(0, 1), embedding_group="embedding", experts=True)
    chunks = {(0, 1): _moe_chunk(1), (1, 0): _moe_chunk(0)}
    sync = ReplicaGradSync(MainParams(chunks, rt, tied=True).by_chunk, rt, overlap=overlap) if kind == "replica" else \
        ShardedMainParams(chunks, rt, tied=True, overlap_reduce=overlap)
    for i, chunk in enumerate(chunks.values()):
        _backward(chunk, i)
    return sync, rt, chunks


# worker 0's ALLREDUCE actions of Chimera D=2's lowered list under --overlap-grad-reduce (lowering's order)
LOWERED = [(0, 1, "stage 1", "stage1"), (0, 1, "experts 1", "experts1"), (1, 0, "stage 0", "stage0"),
           (1, 0, "experts 0", "experts0"), (0, 0, "embedding", "embedding")]


@pytest.mark.parametrize("kind", ["replica", "sharded"])
def test_with_overlap_the_expert_and_embedding_reductions_start_at_their_actions(kind):
    """Each ALLREDUCE action starts its own reduction at once, the experts' over their expert replica
    group and the embedding's over the embedding group, both copies of the embedding summed into the
    one reduced; finish starts nothing more, and leaves every copy of the embedding with the sum."""
    sync, rt, chunks = _chimera_worker(kind, overlap=True)
    tied = [c[1].weight for c in chunks.values()]
    # the distributed optimizer's copies accumulate into one buffer already
    summed = (sum(p.grad for p in tied) if kind == "replica" else tied[0].main_grad).clone()
    for i, action in enumerate(LOWERED):
        sync.start(*action)
        assert [group for group, _, _ in rt.calls] == [group for _, _, group, _ in LOWERED[:i + 1]], rt.calls
    group, reduced, at_start = rt.calls[-1]
    assert group == "embedding" and torch.equal(at_start.view(-1)[:summed.numel()], summed.view(-1)), \
        "the embedding's reduction did not start from both copies' sum"
    sync.finish()
    assert len(rt.calls) == len(LOWERED), f"finish started reductions again: {rt.calls[len(LOWERED):]}"
    if kind == "replica":
        assert all(torch.equal(p.grad, summed) for p in tied), "the embedding's copies differ from their sum"


@pytest.mark.parametrize("kind", ["replica", "sharded"])
def test_without_overlap_the_expert_and_embedding_reductions_run_after_the_schedule_as_before(kind):
    """Megatron-LM's default: the actions start nothing; finish runs every reduction in the one global
    order: stage copies by stage, experts by stage, the embedding."""
    sync, rt, _ = _chimera_worker(kind, overlap=False)
    for action in LOWERED:
        sync.start(*action)
    assert rt.calls == []
    sync.finish()
    assert [group for group, _, _ in rt.calls] == ["stage 0", "stage 1", "experts 0", "experts 1", "embedding"]


def test_the_tied_embedding_is_summed_in_place():
    """The copies' sum lands in the first copy's gradient, which is all-reduced itself (no temporary the
    size of the embedding), then copied into the others."""
    copies = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in range(3)]
    for i, p in enumerate(copies):
        p.global_name, p.grad = TIED_NAME, torch.full((5, 3), float(i + 1))
    rt = _Runtime(embedding_group="embedding")
    ReplicaGradSync({(0, 0): copies[:1], (1, 1): copies[1:]}, rt).finish()
    group, reduced, _ = next(call for call in rt.calls if call[0] == "embedding")
    assert reduced.data_ptr() == copies[0].grad.data_ptr()
    assert all(torch.equal(p.grad, torch.full((5, 3), 6.0)) for p in copies), [p.grad for p in copies]


def test_the_norm_of_large_cpu_gradients_stays_within_fp32_rounding_of_fp64():
    """torch's fp32 CPU norm of one 8M-element tensor is off by about 1e-4; in pieces it is not."""
    torch.manual_seed(0)
    grads = [torch.randn(8 * 2**20) * torch.rand(8 * 2**20) ** 4, torch.randn(3, 7), torch.randn(0)]
    weights = [0.5, 1.0, 0.25]
    expected = sum(w * g.double().pow(2).sum() for g, w in zip(grads, weights))
    got = weighted_square_sum(grads, weights, torch.device("cpu"))
    assert got.dtype == torch.float64
    assert abs(got - expected) / expected < 1e-6


def test_clipping_is_torchs_with_our_norm_and_rounds_as_before():
    """clip_ scales each gradient by max_norm / (norm + 1e-6), that coefficient rounded from the fp64 division
    to fp32 as a Python float multiplier was (bit for bit), and only when it is below 1."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 3000, 1)]
    for trial in range(50):
        for p in params:
            p.grad = torch.randn_like(p) * 10
        before = [p.grad.clone() for p in params]
        norm, max_norm = float(torch.rand(()) * 3), float(torch.rand(()) * 2)
        clip_(params, max_norm, norm)
        coefficient = max_norm / (norm + 1e-6)
        expected = [g * coefficient if coefficient < 1.0 else g for g in before]
        assert all(torch.equal(p.grad, e) for p, e in zip(params, expected)), f"trial {trial}: {norm}, {max_norm}"
