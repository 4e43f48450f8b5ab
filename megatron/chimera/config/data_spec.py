"""Data: paths, split, tokenizer and the dataset builder's settings."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .batch_ramp import batch_steps


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """The tokenizer flags our code reads (megatron-core's builder reads Megatron-LM's namespace itself).
    Built from any namespace with Megatron-LM's tokenizer flags: the trainer's and preprocess_data.py's."""

    kind: str | None  # --tokenizer-type; None only before validation gives Megatron-LM's default
    model: str | None  # --tokenizer-model
    vocab_file: str | None
    merge_file: str | None
    vocab_size: int | None  # the NullTokenizer's

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TokenizerSpec:
        return cls(kind=args.tokenizer_type, model=args.tokenizer_model, vocab_file=args.vocab_file,
                   merge_file=args.merge_file, vocab_size=args.vocab_size)


@dataclass(frozen=True, kw_only=True)
class FimSpec:
    """--fim-data's settings, as Megatron-LM's pretrain_gpt.py hands them to megatron's GPTFIMDatasetConfig."""

    rate: float  # --fim-rate
    spm_rate: float  # --fim-spm-rate
    split_sample: str | None
    fragment_rate: float | None
    no_prefix: str | None
    prefix_token: str
    middle_token: str
    suffix_token: str
    pad_token: str
    eod_token: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FimSpec | None:
        """None without --fim-data."""
        if not args.fim_data:
            return None
        return cls(rate=args.fim_rate, spm_rate=args.fim_spm_rate, split_sample=args.fim_split_sample,
                   fragment_rate=args.fim_fragment_rate, no_prefix=args.fim_no_prefix,
                   prefix_token=args.fim_prefix_token, middle_token=args.fim_middle_token,
                   suffix_token=args.fim_suffix_token, pad_token=args.fim_pad_token, eod_token=args.fim_eod_token)

    def extra_tokens(self) -> dict[str, str]:
        """GPTFIMDatasetConfig's ``fim_extra_tokens``, keyed as pretrain_gpt.py keys them."""
        return {"prefix": self.prefix_token, "middle": self.middle_token, "suffix": self.suffix_token,
                "pad": self.pad_token, "eod": self.eod_token}


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Data: paths, split, tokenizer and the dataset builder's settings, and the batch sizes and run
    lengths that say which samples each iteration and evaluation reads: the run's one home for them,
    which the training loop reads too (the global batch, micro-batch and sequence sizes, --train-iters
    (derived from --train-samples when given), evaluation every ``eval_interval`` iterations and at the
    end, ``eval_iters`` batches). ``seed``: --seed, the datasets' shuffle, and the trainer's torch and
    model-parallel RNG."""

    data_path: tuple[str, ...] | None  # --data-path: prefixes, or a blend of WEIGHT PREFIX pairs
    split: str | None
    mock_data: bool
    cache_path: str | None  # --data-cache-path
    mmap_bin_files: bool
    seq_length: int
    reset_position_ids: bool
    eod_mask_loss: bool
    seed: int
    global_batch_size: int
    batch_steps: tuple[tuple[int, int], ...] | None  # a batch-size ramp's (first sample, size) steps (batch_ramp.py)
    eval_global_batch_size: int  # --eval-global-batch-size, by default the global batch (Megatron-LM's)
    micro_batch_size: int
    data_parallel_size: int
    train_iters: int
    eval_iters: int
    eval_interval: int | None
    tokenizer: TokenizerSpec
    fim: FimSpec | None  # --fim-data: fill-in-the-middle samples
    num_workers: int  # --num-workers: the DataLoader's worker processes
    dataloader_type: str  # --dataloader-type: single (in order) or cyclic (shuffled)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataSpec:
        return cls(data_path=None if args.data_path is None else tuple(args.data_path), split=args.split,
                   mock_data=args.mock_data, cache_path=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
                   seq_length=args.seq_length, reset_position_ids=args.reset_position_ids,
                   eod_mask_loss=args.eod_mask_loss, seed=args.seed, global_batch_size=args.global_batch_size,
                   batch_steps=batch_steps(args), micro_batch_size=args.micro_batch_size,
                   eval_global_batch_size=args.eval_global_batch_size or args.global_batch_size,
                   data_parallel_size=args.data_parallel_size,
                   train_iters=args.train_iters, eval_iters=args.eval_iters, eval_interval=args.eval_interval,
                   tokenizer=TokenizerSpec.from_args(args), fim=FimSpec.from_args(args),
                   num_workers=args.num_workers, dataloader_type=args.dataloader_type)
