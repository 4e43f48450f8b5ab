"""Megatron-LM's tokenizer types: the vocabulary size (so the padded embedding matches Megatron-LM's),
the end-of-document id, and preprocess_data.py writing what the tokenizer says."""
import json
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.data_spec import TokenizerSpec
from megatron.chimera.data.tokenizer import build_tokenizer as build_from_spec
from megatron.chimera.testing.launch import ROOT

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data"]


def build_tokenizer(args):
    """The tokenizer of a validated namespace, as the trainer builds it."""
    return build_from_spec(TokenizerSpec.from_args(args), args)


def test_sentencepiece_types_pad_the_vocabulary_as_megatron_lm(corpus):
    model = corpus[corpus.index("--tokenizer-model") + 1]  # 512 pieces, EOS but no BOS or PAD
    sizes = {}
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        args = parse_args(MODEL + ["--tokenizer-type", kind, "--tokenizer-model", model], world_size=1)
        sizes[kind] = (build_tokenizer(args).vocab_size, args.padded_vocab_size)
    # as Megatron-LM 0.19 builds them (megatron-core's builder): the model's own 512 pieces for every type
    # (legacy Megatron-LM appended <CLS> <SEP> <EOD> <MASK> ... to SentencePieceTokenizer's), documents
    # ended with the model's EOS
    assert sizes == {kind: (512, 512) for kind in sizes}
    tp2 = parse_args(MODEL + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                              "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "192"],
                     world_size=2)
    assert tp2.padded_vocab_size == 768  # a multiple of --make-vocab-size-divisible-by x TP
    eod = build_tokenizer(parse_args(MODEL + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                              model], world_size=1)).eod
    assert eod == sentencepiece.SentencePieceProcessor(model_file=model).eos_id() == 1


def test_null_tokenizer_keeps_its_size_and_ends_documents_with_the_last_id():
    """megatron-core 0.19's NullTokenizer, as Megatron-LM builds it: --vocab-size ids, EOD the last
    (0.16's added one id for EOD)."""
    args = parse_args(MODEL + ["--vocab-size", "128"], world_size=1)
    tokenizer = build_tokenizer(args)
    assert (tokenizer.vocab_size, tokenizer.eod, args.padded_vocab_size) == (128, 127, 128)


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_gpt2_bpe_and_huggingface_tokenizers_preprocess_and_size(gpt2_files, tmp_path, kind):
    files = (["--vocab-file", str(gpt2_files / "vocab.json"), "--merge-file", str(gpt2_files / "merges.txt")]
             if kind == "GPT2BPETokenizer" else ["--tokenizer-model", str(gpt2_files / "hf")])
    args = parse_args(MODEL + ["--tokenizer-type", kind, *files], world_size=1)
    tokenizer = build_tokenizer(args)
    assert (tokenizer.vocab_size, args.padded_vocab_size) == (262, 384)
    assert tokenizer.eod == 261 and tokenizer.tokenize("hello world")[0] == 258  # "hell" merged
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hello world", "hell"]))
    proc = subprocess.run([sys.executable, "scripts/preprocess_data.py", "--input", str(tmp_path / "docs.jsonl"),
                           "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", kind, *files,
                           "--append-eod"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [list(data[i]) for i in range(len(data))] == [tokenizer.tokenize(t) + [261] for t in ["hello world", "hell"]]
    assert np.asarray(data[0]).dtype == np.uint16
