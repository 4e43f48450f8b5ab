"""One process's training pieces for the unit tests: one chunk's forward and backward of a fixed batch (what
the recomputation tests compare: results must not change, the bytes kept for the backward must), and a
whole Trainer in the test process."""
from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.job import job_config
from megatron.chimera.config.run_plan import make_run_plan
from megatron.chimera.loop import Trainer
from megatron.chimera.model.chunk import build_chunk
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.observability.hooks import Hooks


def forward_backward_once(flags: list[str]) -> tuple[float, dict[str, torch.Tensor], int]:
    """(loss, each parameter's gradient, bytes autograd kept for the backward) of stage 0 of the model
    ``flags`` describe, on micro-batch-size sequences of --seq-length tokens; the caller's process group
    must exist (one process)."""
    args = parse_args(flags, world_size=1)
    model_parallel_cuda_manual_seed(args.seed)  # as the Trainer does
    job = job_config(args)
    model = build_chunk(job.model, make_run_plan(job.pipeline, job.parallel), 0, torch.device("cpu"))
    batch, seq = args.micro_batch_size, args.seq_length
    tokens = torch.arange(batch * seq).remainder(args.vocab_size).view(batch, seq)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, torch.arange(seq).expand(batch, seq), None, labels=tokens).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@contextlib.contextmanager
def one_process_trainer(flags: list[str], hooks: Hooks = Hooks()):
    """A one-process Trainer of ``flags`` in the test process; after it, the one-process parallel state the
    caller's process group had (the Trainer's own replaced it and is released)."""
    args = parse_args(flags, world_size=1)
    job = job_config(args)
    built = Trainer(job, make_run_plan(job.pipeline, job.parallel), forward_step, hooks)
    try:
        yield built
    finally:
        built.close()
        parallel_state.initialize_model_parallel(1, 1)
