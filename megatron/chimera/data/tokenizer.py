"""Tokenizers as Megatron-LM 0.19 builds them: megatron-core's ``build_tokenizer``, the one Megatron-LM's
own ``global_vars`` calls, so every --tokenizer-type has Megatron-LM's vocabulary, end-of-document id and
padded size, and embedding shapes, checkpoints and preprocessed ``.bin`` files match Megatron-LM's.

One exception: megatron-core builds GPT2BPETokenizer through HuggingFace's ``AutoTokenizer("gpt2")``,
a download from the hub, even when --vocab-file and --merge-file are given. Here those two files are
read offline by HuggingFace's byte-level BPE, the same algorithm, ending documents with <|endoftext|>.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build

from ..config.data_spec import FimSpec, TokenizerSpec

NEEDS_TRANSFORMERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def default_type(vocab_file: str | None, merge_file: str | None) -> str:
    """Megatron-LM's --tokenizer-type when none is given: GPT-2's BPE with both of its files, else the
    NullTokenizer."""
    return "GPT2BPETokenizer" if vocab_file and merge_file else "NullTokenizer"


def check_arguments(spec: TokenizerSpec, require) -> None:
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


def build_tokenizer(spec: TokenizerSpec, megatron_args: argparse.Namespace):
    """The tokenizer ``spec`` names. ``megatron_args``, Megatron-LM's namespace, goes only to megatron-core's
    builder (every type but GPT2BPETokenizer), which pads the namespace's vocabulary when none is padded yet;
    validation (config/arguments.py) builds the tokenizer first, so afterwards the builder writes nothing."""
    if spec.kind != "GPT2BPETokenizer":
        return megatron_build(megatron_args)
    return GPT2BPE(spec.vocab_file, spec.merge_file)


def check_padded_vocab(size: int, tp: int, tokenizer, require) -> None:
    """--padded-vocab-size is taken as given, as Megatron-LM takes it (its tokenizer pads only without
    it): it must hold every id the tokenizer makes, and megatron-core's vocab-parallel embedding and
    output layer split it evenly over ``tp`` tensor-parallel ranks (Megatron-LM fails on either only
    once running)."""
    ids = tokenizer.vocab_size
    require(size >= ids, "--padded-vocab-size", size, f"must hold the tokenizer's {ids} ids")
    require(size % tp == 0, "--padded-vocab-size", size,
            f"must be a multiple of --tensor-model-parallel-size ({tp}): megatron-core splits the vocabulary evenly")


def check_fim_tokens(fim: FimSpec | None, kind: str, tokenizer, require) -> None:
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


class GPT2BPE:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt, with what Megatron-LM's datasets and
    preprocess_data ask of a tokenizer."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer  # here: HuggingFace's, installed with the optional transformers

        self.bpe = ByteLevelBPETokenizer(vocab_file, merge_file)
        vocab = self.bpe.get_vocab()
        self.vocab_size, self.eod, self.pad = len(vocab), vocab["<|endoftext|>"], -1  # -1: no padding token

    def tokenize(self, text: str) -> list[int]:
        return self.bpe.encode(text).ids

    def detokenize(self, ids) -> str:
        return self.bpe.decode(list(ids))

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "GPT2BPETokenizer", "vocab_size": self.vocab_size, "eod": self.eod}
