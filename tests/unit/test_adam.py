"""AdamW's implementation as the trainer picks it (fused on a GPU, torch's default on the CPU), and what
its step allocates, as torch's kernels do it and as the planner's memory model counts it."""
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from chimera_schedules.tools.planner import Candidate, ModelShape, Precision, Profile, evaluate, step_bytes
from megatron.chimera.config.train_spec import OptimizerSpec
from megatron.chimera.optim.adam import adam_options, adam_state, build_adamw

SPEC = types.SimpleNamespace(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 100)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(100))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_adam_is_fused_on_a_gpu_and_torchs_default_on_the_cpu():
    assert adam_options("cuda") == {"fused": True}, "a GPU's AdamW is not fused"
    assert adam_options(torch.device("cuda", 3)) == {"fused": True}, "a GPU's AdamW is not fused"
    assert adam_options("cpu") == {}, "the CPU's AdamW (the equivalence tests' reference) changed"
    optimizer = build_adamw([{"params": _params()}], SPEC, torch.device("cpu"))
    assert not optimizer.defaults["fused"] and not optimizer.defaults["foreach"], optimizer.defaults
    gpu = build_adamw([{"params": _params()}], SPEC, torch.device("cuda"))  # torch's fused kernel runs here too
    assert gpu.defaults["fused"] and gpu.defaults["lr"] == SPEC.lr, gpu.defaults
    assert set(SPEC.__dict__) <= set(OptimizerSpec.__dataclass_fields__), "build_adamw reads fields OptimizerSpec lacks"
    assert Precision().fused_adam, "the planner's default is not the AdamW the trainer runs on a GPU"


def test_the_step_count_lives_where_the_implementation_reads_it():
    """torch's fused kernel reads the step count on the parameter's device, its loop on the CPU."""
    param = torch.empty(2, device="meta")
    for fused, where in ((True, "meta"), (None, "cpu")):
        state = adam_state(types.SimpleNamespace(defaults={"fused": fused}), param, 7, param, param)
        assert state["step"].device.type == where, (fused, state["step"].device)
        assert state["step"].shape == () and state["step"].dtype == torch.float32, state["step"]


def test_the_fused_kernel_steps_as_torchs_default_adamw():
    """The same AdamW (decoupled weight decay, bias correction) within fp32 rounding: torch's fused CPU
    kernel, the GPU's own, against the loop the CPU runs."""
    loop, fused = _params(), _params()
    optimizers = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw)
                  for ps, kw in ((loop, {}), (fused, {"fused": True}))]
    for _ in range(3):
        for o in optimizers:
            o.step()
    for a, b in zip(loop, fused):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"fused AdamW differs by {(a - b).abs().max()}"


class PeakBytes(TorchDispatchMode):
    """The most bytes of new tensors alive at once while the mode is on (outputs that are not an input)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                self.live += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, t.untyped_storage().nbytes())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


@pytest.mark.parametrize("fused", [False, True])
def test_the_step_allocates_what_the_memory_model_counts(fused):
    """torch's foreach AdamW (the CUDA default) holds sqrt(exp_avg_sq) of the group; the fused kernel
    nothing. Measured on the CPU, where torch runs both implementations on request."""
    params = _params()
    optimizer = torch.optim.AdamW(params, lr=1e-2, **({"fused": True} if fused else {"foreach": True}))
    optimizer.step()  # the state exists
    with PeakBytes() as peak:
        optimizer.step()
    count = sum(p.numel() for p in params)
    assert peak.peak == step_bytes(count, 1, Precision(fused_adam=fused)), (fused, peak.peak, count)
    assert step_bytes(count, 4, Precision(distributed_optimizer=True, fused_adam=fused)) == peak.peak / 4, \
        "the distributed optimizer's step does not shard like its moments"


def test_the_foreach_step_counts_in_a_workers_memory_when_it_exceeds_the_activations():
    """The hand-computed case of test_planner.py: a stage of 99,968 parameters, 16 bytes each, and
    688,128 bytes of live fp32 activations; the foreach step holds 4 bytes per parameter after the flush:
    one stage's under 1F1B (399,872, below the activations, so the peak is theirs), two under Chimera
    (799,744, above them, so the peak is the step's)."""
    shape = ModelShape(layers=4, hidden=64, heads=4, seq=32, vocab=0)
    profile = Profile("test", flops=1e9, p2p_latency=0.0, p2p_bandwidth=float("inf"), allreduce_latency=0.0,
                      allreduce_bandwidth=float("inf"), memory=1e12)
    for name, copies in (("1f1b", 1), ("chimera direct", 2)):
        fused, foreach = (evaluate(shape, profile, 2, Candidate(name, 2, 1, 1, 2), Precision(fused_adam=f)).memory
                          for f in (True, False))
        assert fused == copies * 1_599_488 + 688_128, (name, fused)
        assert foreach == copies * 1_599_488 + max(688_128, copies * 4 * 99_968), (name, foreach)
