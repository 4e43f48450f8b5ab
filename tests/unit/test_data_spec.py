"""The data section of a run's configuration: read once from the namespace validation leaves, frozen, and
all the data code reads (the tokenizer type and padded vocabulary are decided by validation, not by it)."""
import dataclasses
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from megatron.training.datasets.data_samplers import MegatronPretrainingRandomSampler

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.data_spec import DataSpec
from megatron.chimera.config.train_spec import TrainSpec
from megatron.chimera.data.datasets import GlobalBatch, MicrobatchSource, dataset_sizes, evaluation_index, iterators
from megatron.chimera.data.global_batches import GlobalBatches

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


class _Numbered(torch.utils.data.Dataset):
    """Sample i is its own index, and the process that read it."""

    def __len__(self) -> int:
        return 80

    def __getitem__(self, i: int) -> dict:
        return {"tokens": torch.tensor([i]), "reader": torch.tensor([os.getpid()])}


def _source(flags: list[str], dp_rank: int, scale: float = 1.0) -> MicrobatchSource:
    data = DataSpec.from_args(parse_args(MODEL + flags, world_size=2))
    return MicrobatchSource(_Numbered(), data, SimpleNamespace(microbatch_scale=scale), dp_rank, pinned=False,
                            exit_signal=None)


def _samples(source: MicrobatchSource, index: int) -> list[list[int]]:
    return [b["tokens"].view(-1).tolist() for b in source.global_batch(index)]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_each_rank_reads_megatron_lms_order_and_a_resumed_run_the_same_samples(workers):
    """Global batch i, step k, data-parallel rank d (G 8, micro-batch 2, DP 2): samples i G + (k W + d) mbs and the
    next, read in order from batch to batch and again from a later batch, as a resumed run starts."""
    for d in (0, 1):
        source = _source(["--num-workers", workers], d)
        expected = [[[8 * i + (2 * k + d) * 2, 8 * i + (2 * k + d) * 2 + 1] for k in range(2)] for i in range(4)]
        assert [_samples(source, i) for i in range(4)] == expected, f"rank {d}: not Megatron-LM's order"
        resumed = _source(["--num-workers", workers], d)
        assert [_samples(resumed, i) for i in (2, 3)] == expected[2:], f"rank {d}: a resume read other samples"
        assert _samples(resumed, 2) == expected[2], f"rank {d}: an evaluation round read again differs"
        source.close()
        resumed.close()


@pytest.mark.parametrize("workers, in_workers", [("0", False), ("2", True)])
def test_num_workers_reads_the_samples_in_dataloader_workers(workers, in_workers):
    source = _source(["--num-workers", workers], 0)
    readers = {pid for i in range(3) for b in source.global_batch(i) for pid in b["reader"].view(-1).tolist()}
    assert (os.getpid() not in readers) == in_workers, f"--num-workers {workers}: read by {readers}, here {os.getpid()}"
    source.close()


class _Signalled(_Numbered):
    """Each read in a worker signals the worker itself, as Slurm signals every process of a job it preempts."""

    def __init__(self):
        self.parent = os.getpid()

    def __getitem__(self, i: int) -> dict:
        if os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().__getitem__(i)


def test_with_the_exit_signal_handler_workers_survive_the_signal():
    """--exit-signal-handler: the workers record --exit-signal (Megatron-LM's worker_init_fn), so the training
    process, which saves and stops, still gets its samples."""
    data = DataSpec.from_args(parse_args(MODEL + ["--num-workers", "1"], world_size=2))
    source = MicrobatchSource(_Signalled(), data, SimpleNamespace(microbatch_scale=1.0), 0, pinned=False,
                              exit_signal=signal.SIGTERM)
    assert [b["tokens"].view(-1).tolist() for b in source.global_batch(1)] == [[8, 9], [12, 13]]
    source.close()


def test_cyclic_reads_megatron_lms_shuffle_and_resumes_inside_it():
    """--dataloader-type cyclic: MegatronPretrainingRandomSampler's batches for this rank, in its order, from the
    consumed samples on; a resumed run reads on where the whole run would have."""
    source = _source(["--dataloader-type", "cyclic", "--num-workers", "0"], 1)
    run = [_samples(source, i) for i in range(14)]  # 80 samples, 10 global batches: an epoch, then into the next
    batches = list(MegatronPretrainingRandomSampler(_Numbered(), 80, 0, 2, 1, 2, data_sharding=True))
    assert run[:10] == [batches[2 * i:2 * i + 2] for i in range(10)], "not Megatron-LM's shuffle"
    assert sorted(x for batch in run[:10] for step in batch for x in step) == list(range(40, 80)), "rank 1's bucket"
    assert run[10:] != run[:4], "the second epoch is not shuffled anew"
    resumed = _source(["--dataloader-type", "cyclic", "--num-workers", "0"], 1)
    assert [_samples(resumed, i) for i in range(8, 14)] == run[8:], "a resume read other samples"


def test_halved_micro_batches_are_halves_of_the_samplers_micro_batches():
    """Backward halving: the schedule's micro-batch m is half m % 2 of step m // 2, each chunk's in its order."""
    source = _source(["--num-workers", "0"], 1, scale=0.5)
    ends = SimpleNamespace(pre_process=True, post_process=False, mtp_process=False)
    middle = SimpleNamespace(pre_process=False, post_process=False, mtp_process=False)
    first, none = iterators(source, GlobalBatch.at(1, 8), [[3, 0, 1], [2]], [ends, middle], torch.device("cpu"))
    assert [b["tokens"].view(-1).tolist() for b in first] == [[15], [10], [11]], "not the halves of rank 1's steps"
    assert none is None, "a chunk in the middle of the pipeline got data"


def test_a_ramps_batches_read_on_from_the_samples_consumed():
    """Under a batch-size ramp, megatron-core's calculator sizes each batch from the samples consumed before it
    (steps at 12 and 20 samples: 4, 4, 4, 8, 16, 16) and each batch reads the samples after the one before, as a
    new reader from its first sample would (a resumed run)."""
    at = MODEL.index("--global-batch-size")
    flags = MODEL[:at] + MODEL[at + 2:]
    ramp = DataSpec.from_args(parse_args(flags + ["--step-batch-size-schedule", "0:4 192:8 320:16"], world_size=2))
    assert ramp.batch_steps == ((0, 4), (12, 8), (20, 16)) and ramp.global_batch_size == 16, ramp
    batches = GlobalBatches(ramp, 0)
    run = [batches.next() for _ in range(6)]
    assert [b.size for b in run] == [4, 4, 4, 8, 16, 16], run
    assert [b.first_sample for b in run] == [0, 4, 8, 12, 20, 36] and batches.consumed == 52, run
    source = MicrobatchSource(_Numbered(), ramp, SimpleNamespace(microbatch_scale=1.0), 1, pinned=False,
                              exit_signal=None)
    read = [[b["tokens"].view(-1).tolist() for b in source.read(batch)] for batch in run]
    assert read[3] == [[14, 15], [18, 19]], "rank 1's steps of the 8 samples from sample 12"
    fresh = MicrobatchSource(_Numbered(), ramp, SimpleNamespace(microbatch_scale=1.0), 1, pinned=False,
                             exit_signal=None)
    assert [[b["tokens"].view(-1).tolist() for b in fresh.read(batch)] for batch in run[3:]] == read[3:], \
        "a reader started mid-ramp read other samples"
    assert GlobalBatches(ramp, 12).next() == GlobalBatch(12, 8), "a resumed run does not size from its samples"
