"""Tokenizers as Megatron-LM 0.19 builds them: megatron-core's ``build_tokenizer``, the one Megatron-LM's
own ``global_vars`` calls, so every --tokenizer-type has Megatron-LM's vocabulary, end-of-document id and
padded size, and embedding shapes, checkpoints and preprocessed ``.bin`` files match Megatron-LM's.

One exception: megatron-core builds GPT2BPETokenizer through HuggingFace's ``AutoTokenizer("gpt2")``,
a download from the hub, even when --vocab-file and --merge-file are given. Here those two files are
read offline by HuggingFace's byte-level BPE, the same algorithm, ending documents with <|endoftext|>.
"""
from __future__ import annotations

NEEDS_TRANSFORMERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def check_arguments(args, require) -> None:
    """The files each type reads exist; ``require(ok, flag, value, rule)`` reports the first that does not."""
    import importlib.util
    import os

    if args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file and args.merge_file else "NullTokenizer"
    kind = args.tokenizer_type
    if kind in SENTENCEPIECE_TYPES:
        require(bool(args.tokenizer_model) and os.path.isfile(args.tokenizer_model or ""), "--tokenizer-model",
                args.tokenizer_model, "must name an existing SentencePiece model file")
    elif kind == "HuggingFaceTokenizer":
        require(bool(args.tokenizer_model) and os.path.isdir(args.tokenizer_model or ""), "--tokenizer-model",
                args.tokenizer_model, "must name a local HuggingFace tokenizer directory (no hub downloads)")
    elif kind == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            require(bool(path) and os.path.isfile(path or ""), flag, path, "must name an existing file")
    else:
        require(args.vocab_size is not None and args.vocab_size > 0, "--vocab-size", args.vocab_size,
                "must be positive with the NullTokenizer")
    require(kind not in NEEDS_TRANSFORMERS or importlib.util.find_spec("transformers") is not None,
            "--tokenizer-type", kind, "needs the transformers package (pip install transformers)")


def build_tokenizer(args):
    """megatron-core's tokenizer for ``args`` (Megatron-LM's namespace); sets ``args.padded_vocab_size``
    as Megatron-LM does, to a multiple of --make-vocab-size-divisible-by x TP."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    if args.tokenizer_type != "GPT2BPETokenizer":
        return megatron_build(args)
    tokenizer = GPT2BPE(args.vocab_file, args.merge_file)
    if args.pad_vocab_size and getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def check_padded_vocab(args, tokenizer, require) -> None:
    """--padded-vocab-size is taken as given, as Megatron-LM takes it (its tokenizer pads only without
    it): it must hold every id the tokenizer makes, and megatron-core's vocab-parallel embedding and
    output layer split it evenly over tensor parallelism (Megatron-LM fails on either only once running)."""
    size, tp, ids = args.padded_vocab_size, args.tensor_model_parallel_size, tokenizer.vocab_size
    require(size >= ids, "--padded-vocab-size", size, f"must hold the tokenizer's {ids} ids")
    require(size % tp == 0, "--padded-vocab-size", size,
            f"must be a multiple of --tensor-model-parallel-size ({tp}): megatron-core splits the vocabulary evenly")


class GPT2BPE:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt, with what Megatron-LM's datasets and
    preprocess_data ask of a tokenizer."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer  # HuggingFace's, installed with transformers

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
