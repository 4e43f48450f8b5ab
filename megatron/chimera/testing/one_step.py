"""One chunk's forward and backward of a fixed batch, in this process: what the recomputation tests compare
(results must not change, the bytes kept for the backward must)."""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron.chimera.config.arguments import parse_args
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.config.run_plan import make_run_plan
from megatron.chimera.model.chunk import build_chunk


def forward_backward_once(flags: list[str]) -> tuple[float, dict[str, torch.Tensor], int]:
    """(loss, each parameter's gradient, bytes autograd kept for the backward) of stage 0 of the model
    ``flags`` describe, on micro-batch-size sequences of --seq-length tokens; the caller's process group
    must exist (one process)."""
    args = parse_args(flags, world_size=1)
    model_parallel_cuda_manual_seed(args.seed)  # as the Trainer does
    model = build_chunk(ModelSpec.from_args(args), make_run_plan(args), 0, torch.device("cpu"))
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
