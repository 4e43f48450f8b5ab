"""Megatron-LM's fusion flags set a chunk's TransformerConfig as Megatron-LM sets it on a GPU; the fused
weight-gradient kernels' contract (add into ``main_grad``, flag ``grad_added_to_main_grad``) loses and
doubles no gradient under two copies and the distributed optimizer; and Transformer Engine's split of
the backward (delay_wgrad_compute, backward_dw) runs as the executor's I and W. Neither Transformer
Engine nor apex is installed here: stand-ins play their kernels and their availability."""
import threading
import types

import pytest
import torch
from megatron.core import utils
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import moe_utils
from megatron.training.argument_utils import core_transformer_config_from_args
from packaging.version import Version

from chimera_schedules.runtime.autograd_split import backward_input
from megatron.chimera.arguments import parse_args
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.distributed.process_groups import Runtime
from megatron.chimera.model import chunk, kernels
from megatron.chimera.observability.startup import print_building
from megatron.chimera.optim.distributed_optimizer import ShardedMainParams, _accumulate
from megatron.chimera.optim.gradients import ReplicaGradSync
from megatron.chimera.optim.precision import MainParams
from megatron.chimera.testing.equivalence import MIXTRAL
from megatron.chimera.testing.plans import plan_of

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "128"]
FUSIONS = chunk.FUSIONS


@pytest.fixture
def gpu_kernels(monkeypatch):
    """A GPU with apex and Transformer Engine (at ``version``) as far as the config builder asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "importable", lambda module: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *args, **kwargs: None)

    def version(v: str):
        monkeypatch.setattr(utils, "get_te_version", lambda: Version(v))

    version("2.3.0")
    return version


@pytest.mark.parametrize("extra", [
    [], ["--no-gradient-accumulation-fusion"], ["--no-bias-gelu-fusion"], ["--no-bias-dropout-fusion"],
    ["--no-rope-fusion"], ["--no-masked-softmax-fusion"], ["--no-persist-layer-norm"], ["--disable-bias-linear"],
    ["--swiglu"], ["--swiglu", "--no-bias-swiglu-fusion"], ["--swiglu", "--no-bias-gelu-fusion"],
])
def test_fusion_fields_on_a_gpu_are_megatron_lms(gpu_kernels, extra):
    """Each chunk's config, Transformer Engine's and local layers', against Megatron-LM 0.19's own
    core_transformer_config_from_args for the same flags (RoPE, so that its fusion applies)."""
    args = parse_args(BASE + ["--position-embedding-type", "rope"] + extra, world_size=1)
    megatron = core_transformer_config_from_args(args)
    for impl in ("transformer_engine", "local"):
        args.transformer_impl = impl
        ours = chunk.transformer_config(ModelSpec.from_args(args), 2, 0, "cuda")
        assert {f: getattr(ours, f) for f in FUSIONS} == {f: getattr(megatron, f) for f in FUSIONS}, impl
        assert not ours.delay_wgrad_compute
    assert megatron.gradient_accumulation_fusion == ("--no-gradient-accumulation-fusion" not in extra)


def test_fusions_stay_off_on_the_cpu_and_startup_says_so_in_one_line(one_process_group, capsys):
    args = parse_args(BASE + ["--no-rope-fusion"], world_size=1)
    spec = ModelSpec.from_args(args)
    config = chunk.transformer_config(spec, 2, 0, "cpu")
    assert not any(getattr(config, f) for f in FUSIONS), f"fusions on: {[f for f in FUSIONS if getattr(config, f)]}"
    capsys.readouterr()
    print_building(spec, False, "cpu")
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["building GPT model ...",
                     " > fusions kept off: gradient_accumulation_fusion, bias_activation_fusion, bias_dropout_fusion, "
                     "masked_softmax_fusion, persist_layer_norm (on the CPU: their kernels are CUDA's)"]


def test_missing_gpu_kernels_and_a_split_backward_keep_their_fusions_off(gpu_kernels, monkeypatch):
    """Where Megatron-LM would fail (apex or Transformer Engine's fused RoPE not installed), the fusion
    stays off; local linears under a split backward multiply with torch's ops, without the fusion."""
    spec = ModelSpec.from_args(
        parse_args(BASE + ["--position-embedding-type", "rope", "--transformer-impl", "local"], world_size=1))
    assert chunk.transformer_config(spec, 2, 0, "cuda").gradient_accumulation_fusion
    assert "gradient_accumulation_fusion" in chunk.fusions_off(spec, "cuda", split_backward=True)
    assert not chunk.transformer_config(spec, 2, 0, "cuda", split_backward=True).gradient_accumulation_fusion
    monkeypatch.setattr(kernels, "importable", lambda module: module == "transformer_engine.pytorch")
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert set(chunk.fusions_off(spec, "cuda")) == {"gradient_accumulation_fusion", "apply_rope_fusion",
                                                    "masked_softmax_fusion", "persist_layer_norm"}


MOE = MIXTRAL + ["--disable-bias-linear", "--moe-permute-fusion", "--moe-router-fusion"]
MOE_FUSIONS = ("moe_permute_fusion", "moe_router_fusion")
# megatron-core's handles on Transformer Engine's MoE kernels: permutation (2.1 and later), router (2.7 and later)
TE_MOE_KERNELS = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                  "fused_sort_chunks_by_index_with_probs", "fused_unpermute", "fused_topk_with_score_function",
                  "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss")


def test_moe_fusions_reach_the_config_where_transformer_engine_has_their_kernels(gpu_kernels, monkeypatch):
    """--moe-permute-fusion and --moe-router-fusion on a GPU with Transformer Engine's MoE kernels: each chunk's
    config is Megatron-LM's own (core_transformer_config_from_args, whose __post_init__ checks the permutation
    kernels); without those kernels they stay off, each with its reason."""
    gpu_kernels("2.7.0")
    for name in TE_MOE_KERNELS:
        monkeypatch.setattr(moe_utils, name, lambda *args, **kwargs: None)
    args = parse_args(BASE + MOE, world_size=1)
    megatron = core_transformer_config_from_args(args)
    assert (megatron.moe_permute_fusion, megatron.moe_router_fusion) == (True, True)
    for impl in ("transformer_engine", "local"):  # megatron-core's dispatcher and router call them for both
        args.transformer_impl = impl
        ours = chunk.transformer_config(ModelSpec.from_args(args), 2, 0, "cuda")
        assert {f: getattr(ours, f) for f in FUSIONS} == {f: getattr(megatron, f) for f in FUSIONS}, impl
    monkeypatch.setattr(moe_utils, "fused_unpermute", None)
    monkeypatch.setattr(moe_utils, "fused_moe_aux_loss", None)
    spec = ModelSpec.from_args(args)
    assert {f: chunk.fusions_off(spec, "cuda").get(f) for f in MOE_FUSIONS} == {
        "moe_permute_fusion": "needs Transformer Engine's permutation kernels (2.1 or later)",
        "moe_router_fusion": "needs Transformer Engine's fused router (2.7 or later)"}
    config = chunk.transformer_config(spec, 2, 0, "cuda")
    assert not (config.moe_permute_fusion or config.moe_router_fusion), "a MoE fusion on without its kernels"


def test_moe_fusions_stay_off_on_the_cpu_and_startup_says_so(one_process_group, capsys):
    spec = ModelSpec.from_args(parse_args(BASE + MOE, world_size=1))
    assert (spec.config.moe_permute_fusion, spec.config.moe_router_fusion) == (True, True), "not Megatron-LM's"
    config = chunk.transformer_config(spec, 2, 0, "cpu")
    assert not (config.moe_permute_fusion or config.moe_router_fusion), "a MoE fusion on on the CPU"
    capsys.readouterr()
    print_building(spec, False, "cpu")
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(" > fusions kept off: ") and line.endswith(
        "moe_permute_fusion, moe_router_fusion (on the CPU: their kernels are CUDA's)"), line


DUALPIPE = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipe", "--global-batch-size", "8"]


def test_split_backward_with_transformer_engine_before_2_3_is_refused_in_one_line(gpu_kernels, capsys):
    """Megatron-LM's rule for delay_wgrad_compute: 2.3, or 2.7 without gradient-accumulation fusion, or 2.8
    with --overlap-grad-reduce."""
    gpu_kernels("2.2.0")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + DUALPIPE, world_size=2)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("pretrain_gpt.py: error: --transformer-impl=transformer_engine: Transformer Engine's fused")
    assert "--pipeline-schedule dualpipe separates" in err and "Transformer Engine 2.3.0 or later" in err
    assert "installed: 2.2.0" in err
    unsplit = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]
    parse_args(BASE + unsplit, world_size=2)  # no split backward: accepted
    parse_args(BASE + DUALPIPE + ["--transformer-impl", "local"], world_size=2)  # local layers split with torch
    gpu_kernels("2.6.0")
    parse_args(BASE + DUALPIPE, world_size=2)
    for flag, needed in (("--no-gradient-accumulation-fusion", "2.7.0"), ("--overlap-grad-reduce", "2.8.0")):
        with pytest.raises(SystemExit):
            parse_args(BASE + DUALPIPE + [flag], world_size=2)
        assert f"Transformer Engine {needed} or later" in capsys.readouterr().err


def test_split_backward_with_transformer_engine_2_3_delays_its_weight_gradients(gpu_kernels):
    args = parse_args(BASE + DUALPIPE, world_size=2)
    plan = plan_of(args)
    assert plan.split_backward  # read from the schedule's IR: DualPipe splits its own backward
    spec = ModelSpec.from_args(args)
    config = chunk.transformer_config(spec, 1, 0, "cuda", plan.split_backward)
    assert config.delay_wgrad_compute and config.gradient_accumulation_fusion
    assert not chunk.transformer_config(spec, 1, 0, "cpu", plan.split_backward).delay_wgrad_compute


# --- gradient-accumulation fusion: megatron-core's own linear with a stand-in for apex's kernel --------

FUSED = BASE + ["--hidden-dropout", "0", "--attention-dropout", "0", "--pipeline-model-parallel-size", "2",
                # the other fusions' kernels are CUDA's
                "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
                "--no-persist-layer-norm"]


@pytest.fixture
def apex_kernel(monkeypatch):
    """apex's fused_weight_gradient_mlp_cuda as megatron-core's local linear calls it: the weight
    gradient added into ``main_grad``, autograd handed a placeholder (NaN, as an uninitialised one may
    be; zeros where megatron-core asks for them). Returns the calls made."""
    calls = []

    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        calls.append(main_grad.shape)
        main_grad.add_(grad_output.t().matmul(total_input))

    def dummy(shape, dtype, zero=False):
        return torch.zeros(shape, dtype=dtype) if zero else torch.full(shape, float("nan"), dtype=dtype)

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda",
                        types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32), raising=False)
    monkeypatch.setattr(layers, "HAVE_TE", True)
    monkeypatch.setattr(layers, "get_dummy_wgrad", dummy, raising=False)
    return calls


def _main_gradients(args, fused: bool, distributed: bool, monkeypatch, watch=None) -> list[torch.Tensor]:
    """Every stage in this process (two: the tied word embedding a copy in each, which the distributed
    optimizer's tied bucket sums into one buffer; one: both its uses in the same chunk), two micro-batches:
    the fp32 gradients the optimizer steps. ``watch(chunks, sync)``: called before the first forward, with
    --overlap-grad-reduce."""
    model_parallel_cuda_manual_seed(args.seed)  # as the Trainer does
    plan = plan_of(args)
    stages = range(len(plan.layout.stages))
    with monkeypatch.context() as m:
        if fused:
            m.setattr(chunk, "fusions_off", lambda *a, **k: {})
        spec = ModelSpec.from_args(args)
        chunks = {(0, s): chunk.build_chunk(spec, plan, s, torch.device("cpu")) for s in stages}
    assert all(c.config.gradient_accumulation_fusion == fused for c in chunks.values()), \
        [c.config.gradient_accumulation_fusion for c in chunks.values()]
    tied = len(stages) > 1
    rt = Runtime(torch.device("cpu"), "gloo", rank=0, world=1, tp=1, pp=len(stages), dp=1, tp_rank=0, dp_rank=0,
                 worker=0, pipelines=len(plan.placement), embedding_stages=(0, stages[-1]) if tied else (0,))
    overlap = watch is not None
    if distributed:
        main = sync = ShardedMainParams(chunks, rt, tied, overlap)
    else:
        main = MainParams(chunks, rt, tied)
        sync = ReplicaGradSync(main.by_chunk, rt, overlap)
    main.zero_grad(torch.optim.SGD(main.all(), lr=0.0))
    if watch is not None:
        watch(chunks, sync)
    first, last = chunks[(0, 0)], chunks[(0, stages[-1])]
    for mb in range(2):
        labels = tokens = torch.arange(mb, mb + 2 * 16).remainder(128).view(2, 16)
        positions = torch.arange(16).expand(2, 16)
        if tied:
            last.set_input_tensor(first(tokens, positions, None))
            tokens = positions = None
        last(tokens, positions, None, labels=labels).float().sum().backward()
    sync.finish()
    return [p.grad.clone() for p in main.all()]


def _watch_accumulation(undefined: list, starts: list):
    """A ``watch`` for _main_gradients: the names of parameters whose gradient accumulator autograd runs
    without a gradient, and the thread of each reduction start megatron-core's hooks make (as under
    --overlap-grad-reduce). Autograd runs an accumulator on the device of its gradient, and one without a
    gradient on the CPU's ready queue: on a GPU, the thread that called backward, not the device's."""
    accumulators = []  # kept alive, so that the forward's graph uses the nodes hooked here

    def watch(chunks, sync):
        for i, hooks in enumerate(sync.chunk_syncs(list(chunks.values()))):
            hooks.start = lambda i=i, start=hooks.start: (starts.append((i, threading.get_ident())), start())
        for c in chunks.values():
            for name, p in c.named_parameters():
                accumulator = p.view_as(p).grad_fn.next_functions[0][0]  # the node autograd reuses for p
                accumulator.register_prehook(lambda grads, name=name: undefined.append(name) if grads[0] is None
                                             else None)
                accumulators.append(accumulator)

    return watch


@pytest.mark.parametrize("stages", [2, 1])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_weight_gradients_are_neither_lost_nor_doubled(one_process_group, apex_kernel, monkeypatch,
                                                             precision, stages):
    """The main gradients equal an unfused run's. At one stage the tied weight's lookup and logits meet in one
    chunk, whose placeholder megatron-core zeroes (zero_out_wgrad); the fused kernel adds the logits' part
    into the fp32 gradient first, where autograd sums the two parts in the parameters' precision, so they
    agree to its rounding. At two stages each chunk holds one use and zeroes no placeholder. And
    megatron-core's contract, which its DDP keeps with a dummy weight gradient: a fused kernel hands autograd
    a placeholder wherever the weight has ``grad_added_to_main_grad``, and the hook skips it. fp32 weights
    once had no flag, so the kernel handed autograd no gradient, and on a GPU their hooks, which start
    reductions under --overlap-grad-reduce (on in the fused runs), ran on another thread than the rest."""
    pipeline = ["--pipeline-model-parallel-size", str(stages)]
    args = parse_args(FUSED + pipeline + ([] if precision == "fp32" else ["--bf16"]), world_size=stages)
    rounding = 1e-6 if precision == "fp32" else 2.0 ** -7  # bf16: 8 significant bits
    same = torch.equal if stages == 2 else lambda a, b: bool((a - b).abs().max() <= rounding * b.abs().max())
    for distributed in (False, True):
        reference = _main_gradients(args, False, distributed, monkeypatch)
        assert not apex_kernel
        undefined, starts = [], []
        fused = _main_gradients(args, True, distributed, monkeypatch, _watch_accumulation(undefined, starts))
        assert len(apex_kernel) == 2 * (4 + 4 + 1), "2 micro-batches: both layers' 4 linears, the output layer"
        apex_kernel.clear()
        assert all(same(f, r) for f, r in zip(fused, reference)), (precision, distributed, stages)
        assert undefined == [], f"{precision} distributed={distributed}: no gradient reached {sorted(set(undefined))}"
        assert {i for i, _ in starts} == set(range(stages)), f"{precision} distributed={distributed}: started {starts}"
        assert len({thread for _, thread in starts}) == 1, f"reductions started from threads {set(starts)}"


def test_a_tied_weight_zeroes_its_placeholder_only_where_both_its_uses_meet(one_process_group):
    """megatron-core's model of one stage marks the tied word embedding ``zero_out_wgrad``: its logits' fused
    weight-gradient GEMM then hands autograd a zeroed placeholder for the lookup's gradient to add into.
    A chunk of one use (E, or L, of a pipeline) has nothing to add: a zeroed vocabulary-sized placeholder,
    added into ``main_grad`` every micro-batch, would be wasted, and Megatron-LM's stages of a pipeline
    (PP > 1) carry no mark. A last stage of MTP layers holds both: their lookup and the logits."""
    mtp = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    for stages, extra, marked in ((2, [], [False, False]), (1, [], [True]), (2, mtp, [False, True])):
        args = parse_args(FUSED + extra + ["--pipeline-model-parallel-size", str(stages)], world_size=stages)
        plan, spec = plan_of(args), ModelSpec.from_args(args)
        chunks = [chunk.build_chunk(spec, plan, s, torch.device("cpu")) for s in range(stages)]
        got = [getattr(c.shared_embedding_or_output_weight(), "zero_out_wgrad", False) for c in chunks]
        assert got == marked, f"zero_out_wgrad of the tied weight per stage, {stages} stages {extra}: {got}"


def test_fp32_main_parameters_under_the_fusion_are_the_models_storage():
    """What the placeholder costs in fp32: a second parameter object over the same storage, no copy; the
    optimizer's step is the model's, the state is keyed by the model's parameters, and the model-state
    line counts no main weights."""
    model = torch.nn.Linear(3, 2)
    model.config = types.SimpleNamespace(gradient_accumulation_fusion=True)
    main = MainParams({(0, 0): model}, rt=None, tied=False)  # no norms here
    assert [m.data_ptr() for m in main.all()] == [p.data_ptr() for p in model.parameters()], "main weights copied"
    assert all(m is not p for m, p in zip(main.all(), model.parameters())) and not main.half
    assert main.state_bytes() == (0, 4 * 8), main.state_bytes()
    optimizer = torch.optim.AdamW(main.all(), lr=0.1)
    for m in main.all():
        m.grad = torch.ones_like(m)
    before = model.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model.weight, before), "the step did not reach the model's weights"
    states = main.full_state(optimizer, ("exp_avg", "exp_avg_sq", "fp32_param"))
    assert set(states) == {id(p) for p in model.parameters()}, "the state is not keyed by the model's parameters"
    states[id(model.weight)]["fp32_param"] = torch.zeros(2, 3)  # a bf16 run's: not the fp32 model's weights
    main.load_full_state(optimizer, states, 1)
    assert not torch.equal(model.weight, torch.zeros(2, 3)), "an fp32 run took a checkpoint's main weights"


# --- split backward with Transformer Engine's delayed weight gradients, a stand-in ------------------

class _FakeTEModule(torch.nn.Module):
    """transformer_engine.pytorch.module.base.TransformerEngineBaseModule, whose ``backward_dw`` (2.3 to 2.9)
    first reads the layer's weight-gradient store, which only its linears have (their GEMMs: DelayedLinear's
    own backward_dw here): DotProductAttention's fails on that read."""

    def backward_dw(self):
        if self.wgrad_store is None or not self.wgrad_store.delay_wgrad_compute():
            return


class _Store:
    """Transformer Engine's WeightGradStore under delay_wgrad_compute."""

    def delay_wgrad_compute(self):
        return True


class _Queued(torch.autograd.Function):
    """Transformer Engine's linear under delay_wgrad_compute, in miniature: the backward computes the
    input gradient and queues the weight gradient's GEMM; no weight gradient reaches autograd."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.layer.queue.append((x, grad))
        return grad @ weight, None, None


class DelayedLinear(_FakeTEModule):
    """``backward_dw`` as Transformer Engine 2.3-2.7's: into ``main_grad`` when fused, else assigned to an
    empty ``.grad`` only."""

    def __init__(self, weight: torch.Tensor, fused: bool):
        super().__init__()
        self.weight, self.fused, self.queue = torch.nn.Parameter(weight.clone()), fused, []
        self.wgrad_store = _Store()

    def forward(self, x):
        return _Queued.apply(x, self.weight, self)

    def backward_dw(self):
        x, grad = self.queue.pop(0)
        wgrad = grad.t() @ x
        if self.fused:
            self.weight.main_grad.add_(wgrad)
        elif self.weight.grad is None:
            self.weight.grad = wgrad


class Sink(_FakeTEModule):
    """Transformer Engine's DotProductAttention under --softmax-type learnable: a parameter (the attention
    sink, ``softmax_offset``) whose gradient autograd computes, and no weight-gradient store."""

    def __init__(self, offset: torch.Tensor):
        super().__init__()
        self.softmax_offset = torch.nn.Parameter(offset.clone())

    def forward(self, x):
        return torch.softmax(torch.cat([x, self.softmax_offset.expand(len(x), -1)], dim=-1), dim=-1)[:, :4] * 4


def _stack(weights, fused: bool | None, sink: torch.Tensor | None):
    """Delayed, plain, delayed layers (None: all plain, the reference), a sink after the plain one."""
    layers = [torch.nn.Linear(4, 4, bias=False) if fused is None or i == 1 else DelayedLinear(w, fused)
              for i, w in enumerate(weights)]
    for layer, w in zip(layers, weights):
        layer.weight.data.copy_(w)
    return torch.nn.Sequential(*layers[:2], *([] if sink is None else [Sink(sink)]), *layers[2:])


@pytest.mark.parametrize("softmax", ["vanilla", "learnable"])
@pytest.mark.parametrize("gradients", ["persistent", "hook", "fused"])
def test_delayed_weight_gradients_run_as_w(gradients, softmax):
    """I is the whole backward with the stand-in layers' weight GEMMs queued, W their backward_dw, last
    layer first; what they leave reaches the gradient as a whole backward's would: in a persistent
    ``.grad`` (fp32 buffers), through the distributed optimizer's hook (``.grad`` None in I), or, fused,
    straight into ``main_grad``. A learnable softmax's sink delays nothing: its gradient comes in I, once."""
    torch.manual_seed(0)
    weights, inputs = [torch.randn(4, 4) for _ in range(3)], [torch.randn(5, 4) for _ in range(2)]
    sink = torch.randn(1) if softmax == "learnable" else None
    model, reference = _stack(weights, gradients == "fused", sink), _stack(weights, None, sink)
    chunk._delayed_weight_gradients(model)
    params = list(model.parameters())
    delayed = [True, False] + ([False] if sink is not None else []) + [True]
    assert [hasattr(p, "delayed_wgrad") for p in params] == delayed, "only the delaying layers' parameters"
    buffers = [torch.zeros_like(p) for p in params]
    for p, buffer in zip(params, buffers):
        if gradients == "persistent":
            p.grad = buffer
        else:
            p.main_grad, p.grad_added_to_main_grad = buffer, False
            p.register_post_accumulate_grad_hook(_accumulate)
    passes, sent = [], []
    for x in inputs:
        x = x.clone().requires_grad_()
        dx, weight_pass = backward_input(model(x).square().sum(), None, x, params)
        sent.append(dx)
        passes.append(weight_pass)
    for weight_pass in passes:
        weight_pass.run()
    expected = []
    for x in inputs:
        x = x.clone().requires_grad_()
        reference(x).square().sum().backward()
        expected.append(x.grad)
    assert all(torch.allclose(a, b) for a, b in zip(sent, expected)), f"sent {sent}, expected {expected}"
    wanted = [r.grad for r in reference.parameters()]
    assert all(torch.allclose(b, r) for b, r in zip(buffers, wanted)), f"buffers {buffers}, reference {wanted}"
    if gradients == "persistent":
        assert all(p.grad is b for p, b in zip(params, buffers)), "a parameter's .grad is not its main_grad buffer"
