"""Tokenizers as Megatron-LM 0.19 builds them: megatron-core's ``build_tokenizer``, the one Megatron-LM's
own ``global_vars`` calls, so every --tokenizer-type has Megatron-LM's vocabulary, end-of-document id and
padded size, and embedding shapes, checkpoints and preprocessed ``.bin`` files match Megatron-LM's.

One exception: megatron-core builds GPT2BPETokenizer through HuggingFace's ``AutoTokenizer("gpt2")``,
a download from the hub, even when --vocab-file and --merge-file are given. Here those two files are
read offline by HuggingFace's byte-level BPE, the same algorithm, ending documents with <|endoftext|>.
"""
from __future__ import annotations

import argparse

from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build

from ..config.data_spec import TokenizerSpec


def build_tokenizer(spec: TokenizerSpec, megatron_args: argparse.Namespace):
    """The tokenizer ``spec`` names. ``megatron_args``, Megatron-LM's namespace, goes only to megatron-core's
    builder (every type but GPT2BPETokenizer), which pads the namespace's vocabulary when none is padded yet;
    validation (config/tokenizer_rules.py) builds the tokenizer first, so afterwards the builder writes nothing."""
    if spec.kind != "GPT2BPETokenizer":
        return megatron_build(megatron_args)
    return GPT2BPE(spec.vocab_file, spec.merge_file)


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
