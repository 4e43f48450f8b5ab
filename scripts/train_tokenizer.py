"""Train a small SentencePiece model for users who have none.

    python scripts/train_tokenizer.py --input data/corpus.jsonl --model-prefix data/build/tokenizer --vocab-size 512

Reads JSON lines (the --json-key field) or plain text. The model has no BOS and an EOS that Megatron's
tokenizer uses as the end-of-document token.
"""
import argparse
import json
import os

import sentencepiece as spm


def texts(path: str, key: str):
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)[key] if path.endswith(".jsonl") else line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help=".jsonl (one document per line) or plain text")
    p.add_argument("--json-key", default="text")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=texts(args.input, args.json_key), model_prefix=args.model_prefix,
        vocab_size=args.vocab_size, model_type=args.model_type, character_coverage=1.0,
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, hard_vocab_limit=False, minloglevel=2)
    print(f"wrote {args.model_prefix}.model ({args.vocab_size} pieces, {args.model_type})")


if __name__ == "__main__":
    main()
