"""What megatron-core 0.19 hard-codes to CUDA, redirected to the CPU. One module, applied once, and
only when training runs on the CPU (``apply`` refuses when CUDA is in use). With torch's CUDA build on a
machine without a driver, each of these raises "Found no NVIDIA driver"; megatron/chimera/testing/cpu_shim_probe.py
undoes them one at a time against megatron-core's own code, and a test fails when one is no longer
needed.

- ``torch.cuda.current_device()`` (GlobalMemoryBuffer, RoPE's inv_freq, p2p receive buffers) -> CPU;
  ``torch.cuda.synchronize()`` (p2p, the async checkpoint writer) -> no-op.
- The CUDA RNG tracker that attention always enters -> one that keeps CPU generator states; the CUDA
  state that activation recomputation saves and restores beside the CPU one -> nothing.
- Literal ``device="cuda"`` tensors -> CPU, through a ``torch`` proxy seen only by the two modules that
  make them: the token counters of ``pipeline_parallel/schedules.py`` (so megatron-core's own schedules
  run as baselines) and the default causal mask of ``transformer/utils.py``.
- The alltoall token dispatcher's side stream for its device-to-host copies of the split sizes
  (``torch.cuda.Stream``, ``torch.cuda.stream``, events) -> the one CPU stream, through the same proxy
  for ``transformer/moe/token_dispatcher.py``: on the CPU the copies are plain and need no wait. Its
  split sizes become the numpy arrays its GPU path hands all_to_all_single (which takes no tensor):
  megatron-core's ``maybe_move_tensor_to_cpu`` converts only tensors that were on the GPU.
- The schedule plan of --overlap-moe-expert-parallel-comm (``model/schedule_plan.py``): its nodes enter
  a compute or a communication stream and order them with one CUDA event per model chunk -> the one CPU
  stream and an event that has always happened, through the same proxy for the four modules that make
  and run plans; and they tell the caching allocator which stream still uses a tensor
  (``Tensor.record_stream``), which on the CPU, one stream and no caching allocator, means nothing ->
  a no-op for CPU tensors.
- gloo's all_gather and reduce_scatter take equal parts only, where megatron-core's alltoall dispatcher, with
  expert parallelism and expert tensor parallelism, gathers (forward) and reduce-scatters (backward) each
  expert-TP rank's tokens, whose counts differ (``tensor_parallel/mappings.py``, ``output_split_sizes``) ->
  the parts padded to the largest and gathered, or the whole summed and this rank's part kept. It needs two
  processes, so the probe (one) does not undo it; ``tests/integration/test_cpu_compat.py`` runs it on two.
- RoPE's part of the sequence on a context-parallel rank (``get_pos_emb_on_this_cp_rank``) builds its index
  of the rank's chunks in pinned memory and moves it to the GPU -> the same chunks cut by megatron-core's
  batch split, which indexes on the tensor's device (the equivalence harness's CP cases run it at CP=2).
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import mappings, random
from megatron.core.transformer import utils
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.utils import _get_batch_on_this_cp_rank_per_sequence_balancing

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
    """``torch`` as seen by a patched module: tensors asked for on "cuda" land on the CPU, and
    ``torch.cuda``'s streams are the CPU's one."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    @staticmethod
    def ones(*args, device=None, **kwargs):
        return torch.ones(*args, device="cpu" if device == "cuda" else device, **kwargs)

class _CpuStream:
    def wait_stream(self, _):
        pass

    def record_event(self, *args, **kwargs):
        return self

    def synchronize(self):
        pass


_CPU_STREAM = _CpuStream()


class _CpuEvent:
    """An event of the one CPU stream: it has always happened."""

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass


class _CpuCuda:
    """``torch.cuda`` as a patched module sees it: one CPU stream, which every stream is, entering
    which changes nothing, and whose events have always happened; the rest is torch.cuda's."""

    @staticmethod
    def Event(*args, **kwargs):  # noqa: N802  (torch.cuda's spelling)
        return _CpuEvent()

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802  (torch.cuda's spelling)
        return _CPU_STREAM

    @staticmethod
    def current_stream(*args, **kwargs):
        return _CPU_STREAM

    @staticmethod
    def stream(_):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _split_sizes_as_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's maybe_move_tensor_to_cpu for tensors already on the CPU."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream(tensor: torch.Tensor, stream) -> None:
    """``Tensor.record_stream`` for a CUDA tensor; nothing for a CPU one."""
    if tensor.is_cuda:
        _RECORD_STREAM(tensor, stream)


_GATHER, _REDUCE_SCATTER = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim


def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
    """megatron-core's gather along the first dimension; parts of different sizes padded to the largest,
    gathered as equal ones and cut back."""
    if output_split_sizes is None or group.size() == 1:
        return _GATHER(input_, group, output_split_sizes, use_global_buffer)
    most = max(output_split_sizes)
    padded = input_.new_zeros((most, *input_.shape[1:]))
    padded[:input_.shape[0]] = input_
    gathered = _GATHER(padded, group)
    return torch.cat([gathered[i * most:i * most + n] for i, n in enumerate(output_split_sizes)])


def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
    """megatron-core's reduce-scatter along the first dimension; with parts of different sizes, the whole
    summed over the group and this rank's part kept."""
    if input_split_sizes is None or group.size() == 1:
        return _REDUCE_SCATTER(input_, group, input_split_sizes, use_global_buffer)
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    start = sum(input_split_sizes[:group.rank()])
    return total[start:start + input_split_sizes[group.rank()]].contiguous()


def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """megatron-core's get_pos_emb_on_this_cp_rank: this CP rank's chunks of the position embedding, cut by
    megatron-core's batch split (which splits dimension 1)."""
    batch = {"pos_emb": pos_emb.movedim(seq_dim, 1).contiguous()}
    return _get_batch_on_this_cp_rank_per_sequence_balancing(batch, cp_group)["pos_emb"].movedim(1, seq_dim)


PLAN_MODULES = ("megatron.core.pipeline_parallel.utils", "megatron.core.models.common.model_chunk_schedule_plan",
                "megatron.core.models.common.utils", "megatron.core.models.gpt.fine_grained_callables")


def apply() -> None:
    """Idempotent. Call before building models or calling megatron-core schedules on the CPU."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("cpu_compat.apply() on a process that uses CUDA")
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    schedules.torch = utils.torch = token_dispatcher.torch = _CpuTorch()
    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_as_numpy
    for name in PLAN_MODULES:
        importlib.import_module(name).torch = _CpuTorch()
    torch.Tensor.record_stream = _record_stream
    mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim = gather_uneven, reduce_scatter_uneven
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    _applied = True
