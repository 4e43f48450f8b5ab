"""Data for one iteration, identical for every layout.

An iteration reads the global batch after the samples consumed before it: [i G, (i+1) G) of the dataset at a
constant global batch G (under a batch-size ramp, each batch its own size). Megatron-LM's sampler from
consumed_samples i G gives the k-th micro-batch step of data-parallel rank d samples i G + (k W + d) mbs ...
+ mbs (with --dataloader-type cyclic, those positions of its shuffle, in buckets of the data-parallel ranks).
A schedule's micro-batch m maps to step m; with backward halving (``microbatch_scale`` 0.5) IR
micro-batch m is half h = m % 2 of step m // 2. Each chunk that needs data (first or last stage)
gets an iterator over its micro-batches in the order its schedule runs their forwards.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.training.datasets.data_samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.training.dist_signal_handler import DistributedSignalHandler
from megatron.training.training import cyclic_iter
from torch.utils.data import DataLoader

from ..config.data_spec import DataSpec, FimSpec


def dataset_sizes(data: DataSpec) -> tuple[int, int]:
    """Samples the run asks of its train and validation parts (their shuffles depend on it)."""
    evals = (evaluation_index(data, data.train_iters) + 1) * data.eval_iters if data.eval_iters else 0
    return data.train_iters * data.global_batch_size, evals * data.eval_global_batch_size


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
    (each DataLoader worker a copy of it) in the order samples are read: unlike the rest, they depend on the
    layout and --num-workers, and restart on resume."""
    return GPTFIMDatasetConfig(**common, fim_rate=fim.rate, fim_spm_rate=fim.spm_rate,
                               fim_extra_tokens=fim.extra_tokens(), fim_split_sample=fim.split_sample,
                               fim_fragment_rate=fim.fragment_rate, fim_no_prefix=fim.no_prefix)


class GlobalBatch(NamedTuple):
    """One iteration's global batch: the samples consumed before it, and its size."""

    first_sample: int
    size: int

    @classmethod
    def at(cls, index: int, size: int) -> GlobalBatch:
        """Batch ``index`` of a run whose batches all have ``size`` samples."""
        return cls(index * size, size)


class MicrobatchSource:
    """This data-parallel rank's micro-batches of a dataset, read as Megatron-LM reads them: its pretraining
    sampler (--dataloader-type single: in order; cyclic: shuffled per epoch) under a torch DataLoader with
    --num-workers worker processes, pinned for a GPU. Each global batch starts at the samples consumed before it,
    so every iteration, resumed or not, reads the samples it always reads (the module docstring says which).
    Megatron-LM's build_pretraining_data_loader is not called: it reads Megatron-LM's global arguments, which
    this trainer does not set, and its loader starts once, where an evaluation here may read a round again."""

    def __init__(self, dataset, data: DataSpec, plan, dp_rank: int, pinned: bool, exit_signal: int | None):
        """``pinned``: the batches go to a GPU; ``exit_signal``: the signal the workers must survive
        (--exit-signal with --exit-signal-handler: the training process saves, then stops them)."""
        self.dataset, self.data, self.dp_rank = dataset, data, dp_rank
        self.pinned, self.exit_signal = pinned, exit_signal
        self.parts = int(round(1 / plan.microbatch_scale))  # halving: each micro-batch in two halves
        self.size = data.micro_batch_size // self.parts
        self.per_step = data.micro_batch_size * data.data_parallel_size
        self.stream, self.next_sample = None, None

    def global_batch(self, index: int) -> list[dict]:
        """Global batch ``index`` of a run without a ramp (--global-batch-size each)."""
        return self.read(GlobalBatch.at(index, self.data.global_batch_size))

    def read(self, batch: GlobalBatch) -> list[dict]:
        """This rank's micro-batch steps of ``batch``, step k the sampler's k-th batch: read on from the batch
        before, or by a new loader from the batch's first sample (the first read, an evaluation round read
        again)."""
        if batch.first_sample != self.next_sample:
            self.close()
            self.stream = self._read_from(batch.first_sample)
        self.next_sample = batch.first_sample + batch.size
        return [next(self.stream) for _ in range(batch.size // self.per_step)]

    def microbatch(self, steps: list[dict], mb: int) -> dict:
        """The schedule's micro-batch ``mb`` of a global batch's ``steps``: step mb // parts, or with backward
        halving its half mb % parts."""
        step, part = divmod(mb, self.parts)
        return {k: t[part * self.size:(part + 1) * self.size] for k, t in steps[step].items()}

    def _read_from(self, consumed: int):
        data, total = self.data, len(self.dataset)
        if data.dataloader_type == "cyclic":  # data sharding: Megatron-LM's default (--no-data-sharding is refused)
            sampler = MegatronPretrainingRandomSampler(self.dataset, total, consumed, data.micro_batch_size,
                                                       self.dp_rank, data.data_parallel_size, data_sharding=True)
        else:
            sampler = MegatronPretrainingSampler(total, consumed, data.micro_batch_size, self.dp_rank,
                                                 data.data_parallel_size)
        workers = data.num_workers
        # its own generator: the workers' base seed, drawn from torch's global one, would move the model's random
        # stream (dropout on the CPU)
        loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=workers, pin_memory=self.pinned,
                            persistent_workers=workers > 0, generator=torch.Generator(),
                            worker_init_fn=partial(_in_worker, self.exit_signal) if workers else None)
        return cyclic_iter(loader) if data.dataloader_type == "cyclic" else iter(loader)

    def close(self) -> None:
        """Stop the workers (they stop too when the source is dropped); a later read starts a new loader."""
        self.stream, self.next_sample = None, None


def _in_worker(exit_signal: int | None, worker_id: int) -> None:
    """Megatron-LM's worker_init_fn: the workers record --exit-signal instead of dying of it (Slurm signals every
    process of the job). Not its closing of the GPU's file descriptors: a worker exits with its loader."""
    if exit_signal is not None:
        DistributedSignalHandler(exit_signal).__enter__()


def iterators(source: MicrobatchSource, batch: GlobalBatch, orders, chunks, device):
    """One iterator per chunk over its micro-batches of this iteration, all built (and on a GPU their
    copies issued, from the loader's pinned memory, without blocking the host) before the schedule runs, so
    no forward waits for data or syncs the host; None for chunks in the middle of the pipeline (they need
    no data, unless they hold MTP layers), and a rank with only those reads none."""
    needs = [chunk.pre_process or chunk.post_process or chunk.mtp_process for chunk in chunks]
    steps = source.read(batch) if any(needs) else None
    return [iter([{k: t.to(device, non_blocking=True) for k, t in source.microbatch(steps, m).items()}
                  for m in order]) if needed else None for order, needed in zip(orders, needs)]
