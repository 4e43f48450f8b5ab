"""Tokenize JSON lines into Megatron's indexed dataset format (.bin/.idx), as Megatron-LM's
tools/preprocess_data.py does, with megatron-core's IndexedDatasetBuilder.

    python scripts/preprocess_data.py --input data/corpus.jsonl --output-prefix data/build/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/build/tokenizer.model --append-eod

writes data/build/corpus_text_document.{bin,idx}; pass data/build/corpus_text_document to --data-path.
"""
import argparse
import json
import multiprocessing
import os
import time

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training.arguments import _add_tokenizer_args

from megatron.chimera.config.data_spec import TokenizerSpec
from megatron.chimera.config.tokenizer_rules import check_tokenizer_flags, default_type
from megatron.chimera.data.tokenizer import build_tokenizer


class Encoder:
    """Per worker process: one tokenizer, built once."""

    args = None
    tokenizer = None

    @classmethod
    def initializer(cls, args):
        cls.args, cls.tokenizer = args, build_tokenizer(TokenizerSpec.from_args(args), args)

    @classmethod
    def encode(cls, line: str):
        doc = json.loads(line)
        out = {}
        for key in cls.args.json_keys:
            ids = cls.tokenizer.tokenize(doc[key])
            if cls.args.append_eod:
                ids = ids + [cls.tokenizer.eod]
            out[key] = ids
        return out, len(line)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSON lines, one document per line")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    _add_tokenizer_args(p)  # Megatron-LM's tokenizer flags, as its tools/preprocess_data.py adds them
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=1000)
    args = p.parse_args(argv)
    # what megatron-core's tokenizer builder reads besides the tokenizer flags (Megatron-LM's tool sets these too)
    args.rank, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by = 1, 1, 128
    if not os.path.isfile(args.input):
        p.exit(2, f"preprocess_data.py: error: --input={args.input}: no such file\n")

    def require(ok: bool, flag: str, value, rule: str) -> None:
        if not ok:
            p.exit(2, f"preprocess_data.py: error: {flag}={value}: {rule}\n")

    args.tokenizer_type = args.tokenizer_type or default_type(args.vocab_file, args.merge_file)
    check_tokenizer_flags(TokenizerSpec.from_args(args), require)

    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    Encoder.initializer(args)
    dtype = np.int32 if Encoder.tokenizer.vocab_size >= 65500 else np.uint16
    builders = {k: IndexedDatasetBuilder(f"{args.output_prefix}_{k}_document.bin", dtype=dtype)
                for k in args.json_keys}
    start, docs, nbytes = time.time(), 0, 0
    with open(args.input, encoding="utf-8") as f, multiprocessing.Pool(
            args.workers, initializer=Encoder.initializer, initargs=(args,)) as pool:
        for encoded, size in pool.imap(Encoder.encode, f, chunksize=16):
            for key, ids in encoded.items():
                builders[key].add_document(np.array(ids, dtype=dtype), [len(ids)])
            docs, nbytes = docs + 1, nbytes + size
            if docs % args.log_interval == 0:
                elapsed = time.time() - start
                print(f"Processed {docs} documents ({docs / elapsed:.1f} docs/s, {nbytes / elapsed / 2**20:.2f} MB/s).",
                      flush=True)
    for key, builder in builders.items():
        builder.finalize(f"{args.output_prefix}_{key}_document.idx")
    print(f"Processed {docs} documents in {time.time() - start:.1f} s -> "
          + ", ".join(f"{args.output_prefix}_{k}_document" for k in args.json_keys), flush=True)


if __name__ == "__main__":
    main()
