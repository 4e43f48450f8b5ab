"""The data section of a run's configuration: read once from the namespace validation leaves, frozen, and
all the data code reads (the tokenizer type and padded vocabulary are decided by validation, not by it)."""
import dataclasses

import pytest

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.data_spec import DataSpec
from megatron.chimera.config.train_spec import TrainSpec
from megatron.chimera.data.datasets import dataset_sizes, evaluation_index

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "100"]


def test_validation_decides_the_tokenizer_and_the_spec_reads_it_once():
    args = parse_args(MODEL + ["--eval-interval", "4", "--eval-iters", "3"], world_size=2)
    data = DataSpec.from_args(args)
    assert data.tokenizer.kind == "NullTokenizer", "validation gives Megatron-LM's default --tokenizer-type"
    assert args.padded_vocab_size == 128, "validation pads the vocabulary to --make-vocab-size-divisible-by"
    assert (data.global_batch_size, data.micro_batch_size, data.data_parallel_size) == (8, 2, 2), data
    assert (data.mock_data, data.data_path, data.seq_length) == (True, None, 16), data
    with pytest.raises(dataclasses.FrozenInstanceError):
        data.seed = 0


def test_sizes_ask_for_every_evaluation_the_run_makes():
    data = DataSpec.from_args(parse_args(MODEL + ["--eval-interval", "4", "--eval-iters", "3"], world_size=1))
    assert [evaluation_index(data, i) for i in (3, 4, 8, 10)] == [0, 1, 2, 2], "one evaluation per --eval-interval"
    # evaluation indices up to 10 // 4 = 2, each reading --eval-iters (3) batches of 8 samples
    assert dataset_sizes(data) == (10 * 8, 3 * 3 * 8), "train and validation samples"
    no_eval = DataSpec.from_args(parse_args(MODEL + ["--eval-iters", "0"], world_size=1))
    assert dataset_sizes(no_eval) == (80, 0), "--eval-iters 0 asks no validation samples"



def test_the_batches_and_the_run_length_have_one_home():
    """The data section holds the batch sizes, sequence length, seed and run length; the training section,
    which the loop reads beside it, repeats none of them (two copies of one flag could drift apart)."""
    repeated = {f.name for f in dataclasses.fields(TrainSpec)} & {f.name for f in dataclasses.fields(DataSpec)}
    assert repeated == set(), f"fields TrainSpec repeats from DataSpec: {sorted(repeated)}"
