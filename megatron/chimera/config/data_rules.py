"""The data flags: --data-path's prefixes exist, and every part of --split that training reads gets
documents; then the tokenizer's (tokenizer_rules.py)."""
from __future__ import annotations

import os

from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset

from chimera_schedules.ir.errors import require

from .data_spec import TokenizerSpec
from .tokenizer_rules import check_tokenizer_flags, default_type


def check_data(args) -> None:
    """--data-path or --mock-data, --split (Megatron-LM's default with a path), and the tokenizer's flags
    (--tokenizer-type set to Megatron-LM's default when not given: megatron-core's builder reads it)."""
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"  # Megatron-LM's legacy default, which its validate_args also takes
    require(args.mock_data != bool(args.data_path), "--data-path", args.data_path,
            "give exactly one of --data-path and --mock-data")
    if args.data_path:
        prefixes = args.data_path[1::2] if len(args.data_path) > 1 else args.data_path
        if len(args.data_path) > 1:
            require(len(args.data_path) % 2 == 0, "--data-path", " ".join(args.data_path),
                    "a blend is pairs of WEIGHT PREFIX")
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                require(os.path.isfile(prefix + ext), "--data-path", prefix,
                        f"no such file {prefix + ext} (make it with scripts/preprocess_data.py)")
        try:
            splits = [float(x) for x in args.split.replace("/", ",").split(",")]
        except ValueError:
            splits = []
        require(0 < len(splits) <= 3 and splits[0] > 0, "--split", args.split, "train,valid,test with train > 0")
        for prefix in prefixes:
            _require_documents(args, prefix)
    if args.tokenizer_type is None:
        args.tokenizer_type = default_type(args.vocab_file, args.merge_file)
    check_tokenizer_flags(TokenizerSpec.from_args(args), require)


def _require_documents(args, prefix: str) -> None:
    """Every part of --split that training reads (train; valid with --eval-iters) gets at least one
    document of ``prefix``, counted as megatron-core splits it."""
    documents = IndexedDataset(prefix).sequence_lengths.shape[0]
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))
    for name, bookends in zip(("train", "validation"), matrix[:2 if args.eval_iters else 1]):
        count = 0 if bookends is None else round(bookends[1] * documents) - round(bookends[0] * documents)
        require(count > 0, "--split", args.split, f"gives the {name} part 0 of the {documents} documents of "
                f"{prefix}; give it a larger share" + (" or set --eval-iters 0" if name == "validation" else ""))
