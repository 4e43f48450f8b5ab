"""Data for one iteration, identical for every layout.

Iteration i uses samples [i G, (i+1) G) of the dataset (G = global batch). As in Megatron's
sampler, the k-th micro-batch step of data-parallel rank d takes samples (k W + d) mbs ... + mbs.
A schedule's micro-batch m maps to step m; with backward halving (``microbatch_scale`` 0.5) IR
micro-batch m is half h = m % 2 of step m // 2. Each chunk that needs data (first or last stage)
gets an iterator over its micro-batches in the order its schedule runs their forwards.
"""
from __future__ import annotations

import torch

from .tokenizer import build_tokenizer


def dataset_sizes(args) -> tuple[int, int]:
    """Samples the run asks of its train and validation parts (their shuffles depend on it)."""
    evals = (evaluation_index(args, args.train_iters) + 1) * args.eval_iters if args.eval_iters else 0
    return args.train_iters * args.global_batch_size, evals * args.global_batch_size


def evaluation_index(args, iteration: int) -> int:
    """Which evaluation runs after ``iteration``: every --eval-interval, and one at the end (the only
    one when --eval-interval is not given, Megatron-LM 0.19's default)."""
    return iteration // args.eval_interval if args.eval_interval else 0


def build_datasets(args, train_samples: int, valid_samples: int):
    """megatron-core's GPTDataset (blended when --data-path is a blend) or MockGPTDataset."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length,
                              blend=get_blend_from_list(args.data_path), split=args.split,
                              tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
                              reset_attention_mask=False, eod_mask_loss=args.eod_mask_loss, create_attention_mask=False,
                              path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files)
    sizes = [train_samples, valid_samples, 0]
    # A part asked for no samples is not built: a part with no documents would make megatron-core loop
    # until the process-group timeout. The other parts keep Megatron-LM's document ranges.
    config.split_matrix = [bookends if size else None for bookends, size in zip(config.split_matrix, sizes)]
    kind = MockGPTDataset if args.mock_data else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(kind, sizes, lambda: True, config).build()
    return train, valid


class MicrobatchSource:
    """Turns (iteration, micro-batch) into the right samples of a dataset for this data-parallel rank."""

    def __init__(self, dataset, args, plan, dp_rank: int):
        self.dataset, self.dp_rank = dataset, dp_rank
        self.G, self.mbs, self.W = args.global_batch_size, args.micro_batch_size, args.data_parallel_size
        self.parts = int(round(1 / plan.microbatch_scale))  # halving: each micro-batch in two halves
        self.size = self.mbs // self.parts

    def batch(self, iteration: int, mb: int, device) -> dict:
        """One micro-batch on ``device``. On a GPU it is stacked in pinned host memory and copied without
        blocking the host, so building it never waits for the compute stream."""
        step, part = divmod(mb, self.parts)
        start = iteration * self.G + (step * self.W + self.dp_rank) * self.mbs + part * self.size
        samples = [self.dataset[i] for i in range(start, start + self.size)]
        pinned = device.type == "cuda"
        return {k: _stacked(samples, k, pinned).to(device, non_blocking=pinned) for k in samples[0]}


def _stacked(samples: list[dict], key: str, pinned: bool) -> torch.Tensor:
    stacked = torch.stack([s[key] for s in samples])
    return stacked.pin_memory() if pinned else stacked


def iterators(source: MicrobatchSource, iteration: int, orders, chunks, device):
    """One iterator per chunk over its micro-batches of this iteration, all built (and on a GPU their
    copies issued) before the schedule runs, so no forward waits for data or syncs the host; None for
    chunks in the middle of the pipeline (they need no data, unless they hold MTP layers)."""
    out = []
    for order, chunk in zip(orders, chunks):
        if chunk.pre_process or chunk.post_process or chunk.mtp_process:
            out.append(iter([source.batch(iteration, m, device) for m in order]))
        else:
            out.append(None)
    return out
