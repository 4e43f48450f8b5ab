"""Activation recomputation changes memory, not results: the same chunk, with and without
--recompute-granularity full --recompute-method uniform, gives the same loss and gradients while
keeping fewer bytes of activations for the backward pass."""
import torch

from megatron.chimera.config.arguments import parse_args
from megatron.chimera.config.run_plan import make_run_plan
from megatron.chimera.model.chunk import build_chunk

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def step(flags):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    args = parse_args(FLAGS + flags, world_size=1)
    model_parallel_cuda_manual_seed(args.seed)  # as the Trainer does
    model = build_chunk(args, make_run_plan(args), 0, torch.device("cpu"))
    tokens = torch.arange(2 * 64).remainder(128).view(2, 64)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, torch.arange(64).expand(2, 64), None, labels=tokens).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


def test_recomputation_saves_memory_and_keeps_results(one_process_group):
    loss, grads, plain_bytes = step([])
    loss_r, grads_r, recompute_bytes = step(["--recompute-granularity", "full", "--recompute-method", "uniform",
                                             "--recompute-num-layers", "1"])
    assert loss_r == loss
    assert all(torch.equal(grads[n], grads_r[n]) for n in grads)
    assert recompute_bytes < 0.5 * plain_bytes, (recompute_bytes, plain_bytes)
