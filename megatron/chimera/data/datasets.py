"""Data for one iteration, identical for every layout.

Iteration i uses samples [i G, (i+1) G) of the dataset (G = global batch). As in Megatron's
sampler, the k-th micro-batch step of data-parallel rank d takes samples (k W + d) mbs ... + mbs.
A schedule's micro-batch m maps to step m; with backward halving (``microbatch_scale`` 0.5) IR
micro-batch m is half h = m % 2 of step m // 2. Each chunk that needs data (first or last stage)
gets an iterator over its micro-batches in the order its schedule runs their forwards.
"""
from __future__ import annotations

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig

from ..config.data_spec import DataSpec, FimSpec


def dataset_sizes(data: DataSpec) -> tuple[int, int]:
    """Samples the run asks of its train and validation parts (their shuffles depend on it)."""
    evals = (evaluation_index(data, data.train_iters) + 1) * data.eval_iters if data.eval_iters else 0
    return data.train_iters * data.global_batch_size, evals * data.global_batch_size


def evaluation_index(data: DataSpec, iteration: int) -> int:
    """Which evaluation runs after ``iteration``: every --eval-interval, and one at the end (the only
    one when --eval-interval is not given, Megatron-LM 0.19's default)."""
    return iteration // data.eval_interval if data.eval_interval else 0


def build_datasets(data: DataSpec, tokenizer, train_samples: int, valid_samples: int):
    """megatron-core's GPTDataset (blended when --data-path is a blend), Megatron-LM's GPTFIMDataset with
    --fim-data, or MockGPTDataset, picked as Megatron-LM's pretrain_gpt.py picks them. ``tokenizer`` is
    ``tokenizer.build_tokenizer``'s: the datasets read its vocabulary size and end-of-document and padding ids
    (the FIM dataset also re-tokenizes samples through it)."""
    blend = get_blend_from_list(None if data.data_path is None else list(data.data_path))
    common = dict(random_seed=data.seed, sequence_length=data.seq_length, blend=blend, split=data.split,
                  tokenizer=tokenizer, reset_position_ids=data.reset_position_ids, reset_attention_mask=False,
                  eod_mask_loss=data.eod_mask_loss, create_attention_mask=False, path_to_cache=data.cache_path,
                  mmap_bin_files=data.mmap_bin_files)
    config = GPTDatasetConfig(**common) if data.fim is None else _fim_config(data.fim, common)
    sizes = [train_samples, valid_samples, 0]
    # A part asked for no samples is not built: a part with no documents would make megatron-core loop
    # until the process-group timeout. The other parts keep Megatron-LM's document ranges.
    config.split_matrix = [bookends if size else None for bookends, size in zip(config.split_matrix, sizes)]
    kind = MockGPTDataset if data.mock_data else GPTDataset if data.fim is None else GPTFIMDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(kind, sizes, lambda: True, config).build()
    return train, valid


def _fim_config(fim: FimSpec, common: dict) -> GPTFIMDatasetConfig:
    """pretrain_gpt.py's FIM config. GPTFIMDataset draws its permutations from one random stream per process
    in the order samples are read: unlike the rest, they depend on the layout and restart on resume."""
    return GPTFIMDatasetConfig(**common, fim_rate=fim.rate, fim_spm_rate=fim.spm_rate,
                               fim_extra_tokens=fim.extra_tokens(), fim_split_sample=fim.split_sample,
                               fim_fragment_rate=fim.fragment_rate, fim_no_prefix=fim.no_prefix)


class MicrobatchSource:
    """Turns (iteration, micro-batch) into the right samples of a dataset for this data-parallel rank."""

    def __init__(self, dataset, data: DataSpec, plan, dp_rank: int):
        self.dataset, self.dp_rank = dataset, dp_rank
        self.G, self.mbs, self.W = data.global_batch_size, data.micro_batch_size, data.data_parallel_size
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
