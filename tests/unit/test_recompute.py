"""Activation recomputation changes memory, not results: the same chunk, with and without
--recompute-granularity full --recompute-method uniform, gives the same loss and gradients while
keeping fewer bytes of activations for the backward pass."""
import torch

from megatron.chimera.testing.one_step import forward_backward_once

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128", "--num-workers", "0",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def step(flags):
    return forward_backward_once(FLAGS + flags)


def test_recomputation_saves_memory_and_keeps_results(one_process_group):
    loss, grads, plain_bytes = step([])
    loss_r, grads_r, recompute_bytes = step(["--recompute-granularity", "full", "--recompute-method", "uniform",
                                             "--recompute-num-layers", "1"])
    assert loss_r == loss
    assert all(torch.equal(grads[n], grads_r[n]) for n in grads), \
        f"gradients that differ: {[n for n in grads if not torch.equal(grads[n], grads_r[n])]}"
    assert recompute_bytes < 0.5 * plain_bytes, (recompute_bytes, plain_bytes)
