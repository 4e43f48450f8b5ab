"""Data: paths, split, tokenizer and the dataset builder's settings."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
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
        return cls(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.vocab_size)


@dataclass(frozen=True)
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
        return cls(args.fim_rate, args.fim_spm_rate, args.fim_split_sample, args.fim_fragment_rate,
                   args.fim_no_prefix, args.fim_prefix_token, args.fim_middle_token, args.fim_suffix_token,
                   args.fim_pad_token, args.fim_eod_token)

    def extra_tokens(self) -> dict[str, str]:
        """GPTFIMDatasetConfig's ``fim_extra_tokens``, keyed as pretrain_gpt.py keys them."""
        return {"prefix": self.prefix_token, "middle": self.middle_token, "suffix": self.suffix_token,
                "pad": self.pad_token, "eod": self.eod_token}


@dataclass(frozen=True)
class DataSpec:
    """Data: paths, split, tokenizer and the dataset builder's settings, and the batch sizes and run
    lengths that say which samples each iteration and evaluation reads."""

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
        return cls(None if args.data_path is None else tuple(args.data_path), args.split, args.mock_data,
                   args.data_cache_path, args.mmap_bin_files, args.seq_length, args.reset_position_ids,
                   args.eod_mask_loss, args.seed, args.global_batch_size, args.micro_batch_size,
                   args.data_parallel_size, args.train_iters, args.eval_iters, args.eval_interval,
                   TokenizerSpec.from_args(args), FimSpec.from_args(args), args.num_workers, args.dataloader_type)
