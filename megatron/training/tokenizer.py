"""Tokenizers by Megatron's --tokenizer-type names, through megatron-core's MegatronTokenizer."""
from __future__ import annotations


def build_tokenizer(args):
    from megatron.core.tokenizers import MegatronTokenizer

    if args.tokenizer_type == "SentencePieceTokenizer":
        return MegatronTokenizer.from_pretrained(args.tokenizer_model,
                                                 metadata_path={"library": "sentencepiece", "model_type": "gpt"})
    return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=args.vocab_size)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: a multiple of --make-vocab-size-divisible-by x TP."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
