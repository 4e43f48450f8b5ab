"""Tokenizers by Megatron-LM's --tokenizer-type names, with Megatron-LM's vocabulary size and
end-of-document id for each type, so embedding shapes, checkpoints and preprocessed ``.bin`` files
match Megatron-LM's.

The text models are megatron-core's (its SentencePiece, HuggingFace and null tokenizers); GPT-2's BPE
files are read by HuggingFace's byte-level BPE, the same algorithm Megatron-LM implements.
The per-type rules are Megatron-LM's:
- SentencePieceTokenizer appends <CLS> <SEP> <EOD> <MASK>, and <PAD> <BOS> <EOS> where the model
  has no such piece; its end of document is <EOD>;
- GPTSentencePieceTokenizer and Llama2Tokenizer keep the model's vocabulary, end documents with its
  EOS, and Llama2 starts every text with BOS;
- HuggingFaceTokenizer counts added tokens too (``len(tokenizer)``); GPT2BPETokenizer ends with
  <|endoftext|>; NullTokenizer has --vocab-size ids, EOD the last (megatron-core 0.19).
"""
from __future__ import annotations

TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
         "HuggingFaceTokenizer", "NullTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
NEEDS_TRANSFORMERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer")


def add_arguments(group) -> None:
    """Megatron-LM's tokenizer flags, shared by pretrain_gpt.py and scripts/preprocess_data.py."""
    group.add_argument("--tokenizer-type", choices=TYPES,
                       help="default: GPT2BPETokenizer with --vocab-file and --merge-file (as Megatron-LM's GPT-3 "
                            "example relies on), NullTokenizer otherwise")
    group.add_argument("--tokenizer-model", help="SentencePiece model file, or a local HuggingFace tokenizer directory")
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: ids 0..N-1, EOD = N-1")


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


class Tokenizer:
    """What the datasets and preprocess_data.py ask of a tokenizer."""

    def __init__(self, kind: str, encode, decode, vocab_size: int, eod: int, pad: int | None = None):
        self.kind, self._encode, self._decode = kind, encode, decode
        # -1: no padding token (megatron-core's datasets then mask nothing as padding)
        self.vocab_size, self.eod, self.pad = vocab_size, eod, -1 if pad is None else pad

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))

    def detokenize(self, ids) -> str:
        return self._decode(list(ids))

    @property
    def unique_identifiers(self) -> dict:
        return {"class": f"{self.kind}", "vocab_size": self.vocab_size, "eod": self.eod}


def build_tokenizer(args) -> Tokenizer:
    kind = args.tokenizer_type
    if kind in SENTENCEPIECE_TYPES:
        return _sentencepiece(kind, args.tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        return _huggingface(args.tokenizer_model)
    if kind == "GPT2BPETokenizer":
        return _gpt2_bpe(args.vocab_file, args.merge_file)
    from megatron.core.tokenizers import MegatronTokenizer

    null = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=args.vocab_size)
    return Tokenizer(kind, null.tokenize, null.detokenize, null.vocab_size, null.eod)


def _sentencepiece(kind: str, model: str) -> Tokenizer:
    from megatron.core.tokenizers import MegatronTokenizer

    metadata = {"library": "sentencepiece", "model_type": "gpt"}
    if kind != "SentencePieceTokenizer":
        sp = MegatronTokenizer.from_pretrained(model, metadata_path=metadata)._tokenizer
        bos = [sp.tokenizer.bos_id()] if kind == "Llama2Tokenizer" and sp.tokenizer.bos_id() >= 0 else []
        return Tokenizer(kind, lambda text: bos + sp.text_to_ids(text), sp.ids_to_text, sp.vocab_size,
                         sp.tokenizer.eos_id(), sp.tokenizer.pad_id())
    plain = MegatronTokenizer.from_pretrained(model, metadata_path=metadata)._tokenizer.tokenizer

    def piece(index: int, fallback: str) -> str:
        return plain.id_to_piece(index) if 0 <= index < plain.get_piece_size() else fallback

    specials = ["<CLS>", "<SEP>", "<EOD>", "<MASK>", piece(plain.pad_id(), "<PAD>"), piece(plain.bos_id(), "<BOS>"),
                piece(plain.eos_id(), "<EOS>")]
    sp = MegatronTokenizer.from_pretrained(model, metadata_path=metadata, legacy=True,
                                           special_tokens=specials)._tokenizer
    return Tokenizer(kind, sp.text_to_ids, sp.ids_to_text, sp.vocab_size, sp.token_to_id("<EOD>"),
                     sp.token_to_id(specials[4]))


def _huggingface(directory: str) -> Tokenizer:
    from megatron.core.tokenizers import MegatronTokenizer

    hf = MegatronTokenizer.from_pretrained(directory, metadata_path={"library": "huggingface", "model_type": "gpt"})
    inner = hf._tokenizer.tokenizer  # transformers' tokenizer
    return Tokenizer("HuggingFaceTokenizer", lambda text: inner(text)["input_ids"], inner.decode, len(inner),
                     inner.eos_token_id, inner.pad_token_id)


def _gpt2_bpe(vocab_file: str, merge_file: str) -> Tokenizer:
    from tokenizers import ByteLevelBPETokenizer  # HuggingFace's, installed with transformers

    bpe = ByteLevelBPETokenizer(vocab_file, merge_file)
    encoder = bpe.get_vocab()
    return Tokenizer("GPT2BPETokenizer", lambda text: bpe.encode(text).ids, bpe.decode, len(encoder),
                     encoder["<|endoftext|>"])


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: a multiple of --make-vocab-size-divisible-by x TP."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
