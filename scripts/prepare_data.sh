#!/usr/bin/env bash
# The shipped corpus -> a SentencePiece model and Megatron .bin/.idx files under data/build/.
set -euo pipefail
cd "$(dirname "$0")/.."
python scripts/train_tokenizer.py --input data/corpus.jsonl --model-prefix data/build/tokenizer --vocab-size 512
python scripts/preprocess_data.py --input data/corpus.jsonl --output-prefix data/build/corpus \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model data/build/tokenizer.model --append-eod --workers 2 --log-interval 10
