"""What megatron-core 0.19 hard-codes to CUDA, redirected to the CPU. One module, applied once, and
only when training runs on the CPU (``apply`` refuses when CUDA is in use). With torch's CUDA build on a
machine without a driver, each of these raises "Found no NVIDIA driver"; tests/cpu_shim_probe.py
undoes them one at a time against megatron-core's own code, and a test fails when one is no longer
needed.

- ``torch.cuda.current_device()`` (GlobalMemoryBuffer, RoPE's inv_freq, p2p receive buffers) -> CPU;
  ``torch.cuda.synchronize()`` (p2p, the async checkpoint writer) -> no-op.
- The CUDA RNG tracker that attention always enters -> one that keeps CPU generator states; the CUDA
  state that activation recomputation saves and restores beside the CPU one -> nothing.
- Literal ``device="cuda"`` tensors -> CPU, through a ``torch`` proxy seen only by the two modules that
  make them: the token counters of ``pipeline_parallel/schedules.py`` (so megatron-core's own schedules
  run as baselines) and the default causal mask of ``transformer/utils.py``.
"""
from __future__ import annotations

import contextlib
import types

import torch

_applied = False


class CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker contract (add / fork / get_states / set_states / reset) over
    CPU generator states."""

    def __init__(self):
        self.reset()

    def is_initialized(self):
        return bool(self.states_)

    def reset(self):
        self.states_, self.seeds_ = {}, set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a patched module: tensors asked for on "cuda" land on the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    @staticmethod
    def ones(*args, device=None, **kwargs):
        return torch.ones(*args, device="cpu" if device == "cuda" else device, **kwargs)


def apply() -> None:
    """Idempotent. Call before building models or calling megatron-core schedules on the CPU."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("cpu_compat.apply() on a process that uses CUDA")
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import utils

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    schedules.torch = utils.torch = _CpuTorch()
    _applied = True
