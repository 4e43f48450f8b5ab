"""Megatron's --data-path blend syntax goes through megatron-core's BlendedDataset; one prefix gives a
plain GPTDataset. Both read the files scripts/preprocess_data.py wrote from the shipped corpus."""
from megatron.chimera.config.arguments import parse_args
from megatron.chimera.config.data_spec import DataSpec
from megatron.chimera.data.datasets import build_datasets
from megatron.chimera.data.tokenizer import build_tokenizer

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "5", "--lr", "1e-3"]


def test_single_prefix_and_blend(one_process_group, corpus):
    prefix = corpus[corpus.index("--data-path") + 1]
    tokenizer = corpus[corpus.index("--data-path") + 2:]
    single = parse_args(MODEL + ["--data-path", prefix] + tokenizer, world_size=1)
    validated = dict(vars(single))
    train, valid = _datasets(single, 20, 4)
    assert vars(single) == validated, "building the tokenizer and datasets wrote to Megatron-LM's namespace"
    assert type(train).__name__ == "GPTDataset" and len(train) >= 20
    blend = parse_args(MODEL + ["--data-path", "0.3", prefix, "0.7", prefix] + tokenizer, world_size=1)
    train_b, valid_b = _datasets(blend, 20, 4)
    assert type(train_b).__name__ == "BlendedDataset" and len(train_b) == 20
    sample = train_b[0]
    assert set(sample) >= {"tokens", "labels", "loss_mask", "position_ids"} and sample["tokens"].shape == (32,)
    assert int(sample["tokens"].max()) < single.padded_vocab_size


def _datasets(args, train_samples: int, valid_samples: int):
    data = DataSpec.from_args(args)
    return build_datasets(data, build_tokenizer(data.tokenizer, args), train_samples, valid_samples)
