"""The tokenizer the flags name: its files exist, and the vocabulary the run pads (--padded-vocab-size, or
Megatron-LM's padding of the tokenizer's ids) holds every id and splits over TP; with --fim-data, the
tokenizer holds its tokens. Also preprocess_data.py's checks of the same flags.

Building the tokenizer is the data layer's (data/tokenizer.py): ``check_tokenizer`` is handed its builder
(layer_probes.py), so config imports nothing from data/.
"""
from __future__ import annotations

import importlib.util
import os

from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

from chimera_schedules.ir.errors import require

from .data_spec import FimSpec, TokenizerSpec

NEEDS_TRANSFORMERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def default_type(vocab_file: str | None, merge_file: str | None) -> str:
    """Megatron-LM's --tokenizer-type when none is given: GPT-2's BPE with both of its files, else the
    NullTokenizer."""
    return "GPT2BPETokenizer" if vocab_file and merge_file else "NullTokenizer"


def check_tokenizer_flags(spec: TokenizerSpec, require) -> None:
    """The files each type reads exist; ``require(ok, flag, value, rule)`` reports the first that does not."""
    kind = spec.kind
    if kind in SENTENCEPIECE_TYPES:
        require(bool(spec.model) and os.path.isfile(spec.model or ""), "--tokenizer-model", spec.model,
                "must name an existing SentencePiece model file")
    elif kind == "HuggingFaceTokenizer":
        require(bool(spec.model) and os.path.isdir(spec.model or ""), "--tokenizer-model", spec.model,
                "must name a local HuggingFace tokenizer directory (no hub downloads)")
    elif kind == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", spec.vocab_file), ("--merge-file", spec.merge_file)):
            require(bool(path) and os.path.isfile(path or ""), flag, path, "must name an existing file")
    else:
        require(spec.vocab_size is not None and spec.vocab_size > 0, "--vocab-size", spec.vocab_size,
                "must be positive with the NullTokenizer")
    require(kind not in NEEDS_TRANSFORMERS or importlib.util.find_spec("transformers") is not None,
            "--tokenizer-type", kind, "needs the transformers package (pip install transformers)")


def check_tokenizer(args, build_tokenizer) -> None:
    """Megatron-LM's padded vocabulary, decided here once: --padded-vocab-size as given, else the tokenizer's
    ids rounded up to a multiple of --make-vocab-size-divisible-by x TP (megatron-core's builder sets it so
    for its tokenizers; GPT2BPETokenizer is ours). With --fim-data, the tokenizer holds its tokens.
    ``build_tokenizer``: data/tokenizer.py's, which hands the namespace to megatron-core's builder."""
    spec = TokenizerSpec.from_args(args)
    tokenizer = build_tokenizer(spec, args)
    if args.pad_vocab_size and args.padded_vocab_size is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    _check_padded_vocab(args.padded_vocab_size, args.tensor_model_parallel_size, tokenizer)
    _check_fim_tokens(FimSpec.from_args(args), spec.kind, tokenizer)


def _check_padded_vocab(size: int, tp: int, tokenizer) -> None:
    """--padded-vocab-size is taken as given, as Megatron-LM takes it (its tokenizer pads only without
    it): it must hold every id the tokenizer makes, and megatron-core's vocab-parallel embedding and
    output layer split it evenly over ``tp`` tensor-parallel ranks (Megatron-LM fails on either only
    once running)."""
    ids = tokenizer.vocab_size
    require(size >= ids, "--padded-vocab-size", size, f"must hold the tokenizer's {ids} ids")
    require(size % tp == 0, "--padded-vocab-size", size,
            f"must be a multiple of --tensor-model-parallel-size ({tp}): megatron-core splits the vocabulary evenly")


def _check_fim_tokens(fim: FimSpec | None, kind: str, tokenizer) -> None:
    """--fim-data: Megatron-LM's GPTFIMDataset re-tokenizes each sample through megatron-core's HuggingFace
    library (no other type here takes its ``ids_to_text(..., remove_special_tokens=True)``; Megatron-LM fails
    on the first sample) and looks its sentinel tokens up by name, where a token missing from the
    vocabulary would silently become the unknown token's id (or None)."""
    if fim is None:
        return
    require(kind == "HuggingFaceTokenizer", "--fim-data", True,
            "needs --tokenizer-type HuggingFaceTokenizer (Megatron-LM's FIM dataset re-tokenizes samples through it)")
    named = {**{f"--fim-{part}-token": token for part, token in fim.extra_tokens().items()},
             "--fim-split-sample": fim.split_sample}
    library = tokenizer._tokenizer
    for flag, token in named.items():
        require(token is None or library.inv_vocab.get(library.token_to_id(token)) == token, flag, token,
                "must be a token of the tokenizer's vocabulary (Megatron-LM's FIM dataset looks it up by name)")
