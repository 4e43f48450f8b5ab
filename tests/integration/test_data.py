"""Megatron's --data-path blend syntax goes through megatron-core's BlendedDataset; one prefix gives a
plain GPTDataset. Both read the files scripts/preprocess_data.py wrote from the shipped corpus. --fim-data
gives Megatron-LM's GPTFIMDataset over documents of a HuggingFace tokenizer that holds the FIM tokens."""
import json
import os

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.data_spec import DataSpec
from megatron.chimera.data.datasets import build_datasets
from megatron.chimera.data.tokenizer import build_tokenizer
from megatron.chimera.testing.launch import ROOT

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


FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]  # Megatron-LM's defaults


@pytest.fixture
def fim_files(gpt2_files, tmp_path):
    """The small GPT-2 tokenizer with Megatron-LM's FIM tokens added, as a local HuggingFace directory, and
    the shipped corpus's first documents in its ids, as preprocess_data.py writes them."""
    from transformers import PreTrainedTokenizerFast  # seconds to import: the FIM tests' alone

    hf = PreTrainedTokenizerFast.from_pretrained(gpt2_files / "hf")
    hf.add_special_tokens({"additional_special_tokens": FIM_TOKENS})
    hf.save_pretrained(tmp_path / "hf")
    builder = IndexedDatasetBuilder(str(tmp_path / "docs.bin"), dtype=np.int32)
    with open(os.path.join(ROOT, "data", "corpus.jsonl"), encoding="utf-8") as f:
        for line in list(f)[:4]:
            ids = hf(json.loads(line)["text"]).input_ids + [hf.eos_token_id]
            builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(str(tmp_path / "docs.idx"))
    return tmp_path, hf.convert_tokens_to_ids(FIM_TOKENS[:3])


def test_fim_data_permutes_samples_with_megatron_lms_fim_dataset(one_process_group, fim_files):
    folder, sentinels = fim_files
    flags = MODEL + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder / "hf"),
                     "--data-path", str(folder / "docs"), "--split", "100,0,0", "--eval-iters", "0", "--fim-data",
                     "--fim-rate", "1"]
    train, _ = _datasets(parse_args(flags, world_size=1), 8, 0)
    assert type(train).__name__ == "GPTFIMDataset", f"--fim-data built {type(train).__name__}"
    tokens = set(torch.cat([train[i]["tokens"] for i in range(8)]).tolist())
    assert set(sentinels) <= tokens, f"no FIM sentinel ids {sentinels} in the samples at --fim-rate 1"


@pytest.mark.parametrize("tokenizer, flag", [("hf", "--fim-prefix-token"), ("null", "--fim-data")])
def test_fim_data_is_refused_before_start_without_the_fim_tokens(gpt2_files, fim_files, capsys, tokenizer, flag):
    tokenizer = (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(gpt2_files / "hf")]
                 if tokenizer == "hf" else ["--vocab-size", "128"])
    with pytest.raises(SystemExit):
        parse_args(MODEL + tokenizer + ["--data-path", str(fim_files[0] / "docs"), "--eval-iters", "0", "--fim-data"],
                   world_size=1)
    assert flag in capsys.readouterr().err, f"the refusal does not name {flag}"
