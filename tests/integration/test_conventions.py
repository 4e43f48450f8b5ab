"""Megatron-LM's conventions that scripts, log parsers and Slurm requeues rely on: the startup banner,
--save X --load X on a first launch, --exit-interval and --exit-duration-in-mins saving and exiting
like SIGTERM, a launch after the run's end changing nothing, an error printed once per job (not once
per rank), and no hang on an empty split.

The one-process runs share one launch (megatron.chimera.testing.cases): each is pretrain_gpt.py's
flags, run in turn, with its own output and exit code, as a launch of its own would print them."""
import re
from types import SimpleNamespace

import pytest
import torch

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.checkpoint_spec import CheckpointSpec
from megatron.chimera.config.train_spec import ExitSpec
from megatron.chimera.loop import _ExitPolicy
from megatron.chimera.testing.cases import run_cases
from megatron.chimera.testing.launch import losses, run, train_args

MODEL = ["pretrain_gpt.py", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "4",
         "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]


def lrs(proc) -> list[str]:
    return re.findall(r"learning rate: (\S+) \|", proc.stdout)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Every one-process run of this module, in one launch, in the order a user would launch them."""
    folder = tmp_path_factory.mktemp("conventions")
    chained = MODEL + ["--save", str(folder / "run"), "--load", str(folder / "run"), "--save-interval", "100",
                       "--exit-interval", "2"]
    at = MODEL.index("--train-iters")
    lr_ckpt = str(folder / "lr")
    cases = {
        "first": chained,
        "second": chained + ["--exit-interval", "3"],
        "third": chained,
        "whole": MODEL + ["--log-throughput", "--timing-log-level", "1"],
        "load elsewhere": MODEL + ["--save", str(folder / "a"), "--save-interval", "2", "--load", str(folder / "b")],
        "empty test split": train_args(corpus, "--split", "949,50,1", "--train-iters", "2"),
        "empty validation split": train_args(corpus, "--split", "99,1,0", "--save", str(folder / "c"),
                                             "--save-interval", "2"),
        "by iterations": MODEL + ["--lr-warmup-iters", "1", "--lr-decay-iters", "3", "--lr-decay-style", "cosine"],
        "by samples": MODEL[:at] + MODEL[at + 2:] + ["--train-samples", "8", "--lr-warmup-samples", "2",
                                                     "--lr-decay-samples", "6", "--lr-decay-style", "cosine"],
        "lr saved": MODEL + ["--save", lr_ckpt, "--save-interval", "2", "--exit-interval", "2"],
        "lr changed": MODEL + ["--load", lr_ckpt, "--lr", "2e-3"],
        "lr overridden": MODEL + ["--load", lr_ckpt, "--lr", "2e-3", "--override-opt_param-scheduler"],
        "lr kept": MODEL + ["--load", lr_ckpt, "--lr", "2e-3", "--use-checkpoint-opt_param-scheduler"],
    }
    return run_cases(1, cases), chained, folder


def ok(runs, name: str):
    proc = runs[0][name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_same_save_and_load_starts_from_scratch_then_resumes_and_exits_on_its_limits(runs):
    _, chained, folder = runs
    ckpt = str(folder / "run")
    first = ok(runs, "first")
    banner = first.stdout.split("-------------------- end of arguments ---------------------")[0]
    assert "------------------------ arguments ------------------------" in banner  # Megatron-LM's validate_args
    assert "  exit_interval " in banner and "building GPT model ..." in first.stdout
    assert " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): " in first.stdout
    assert f"no checkpoint in {ckpt} yet (--load = --save): starting from scratch" in first.stdout
    assert "exiting on --exit-interval 2 at iteration 2 after saving it" in first.stdout
    assert sorted(losses(first)) == [1, 2]
    second = ok(runs, "second")
    assert f"loaded checkpoint from {ckpt} at iteration 2" in second.stdout
    assert "exiting on --exit-interval 3 at iteration 3 after saving it" in second.stdout
    third = ok(runs, "third")
    assert f"loaded checkpoint from {ckpt} at iteration 3" in third.stdout and sorted(losses(third)) == [4]
    saved = sorted((p.name, p.stat().st_mtime_ns) for p in (folder / "run").rglob("*"))
    fourth = run(1, *chained, "--eval-iters", "1")  # a requeued job after the end: nothing trained or written
    assert "training already complete at iteration 4 (--train-iters 4): nothing to train" in fourth.stdout
    assert "\ntraining ...\n" not in fourth.stdout and not losses(fourth)
    assert "validation loss at iteration 4" in fourth.stdout  # as Megatron-LM, it evaluates what it loaded
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (folder / "run").rglob("*")) == saved
    whole = ok(runs, "whole")
    assert losses(whole) == {**losses(first), **losses(second), **losses(third)}
    assert len(re.findall(r"\| throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \|", whole.stdout)) == 4
    # Megatron-LM's timer blocks: setup once (level 0), then per log line (level 1)
    setup = re.search(r"done with setup \.\.\.\n\(min, max\) time across ranks \(ms\):\n"
                      r"    model-and-optimizer-setup \.+: \(\d+\.\d\d, \d+\.\d\d\)\n"
                      r"    train/valid/test-data-iterators-setup \.+: ", whole.stdout)
    assert setup and "done with setup" not in first.stdout.split("\ntraining ...\n")[1]
    assert len(re.findall(r"\n    forward-backward \.+: \(\d+\.\d\d, \d+\.\d\d\)\n", whole.stdout)) == 4
    assert "forward-backward" not in first.stdout  # level 0 by default


def test_load_elsewhere_without_a_checkpoint_is_still_an_error(runs):
    proc = runs[0]["load elsewhere"]
    assert proc.returncode == 2 and "no checkpoint there" in proc.stderr


def test_exit_on_missing_checkpoint_makes_a_first_launch_an_error(tmp_path, capsys):
    same = ["--save", str(tmp_path / "a"), "--save-interval", "2", "--load", str(tmp_path / "a")]
    assert CheckpointSpec.from_args(parse_args(MODEL[1:] + same, world_size=1)).fresh_start == str(tmp_path / "a")
    with pytest.raises(SystemExit):
        parse_args(MODEL[1:] + same + ["--exit-on-missing-checkpoint"], world_size=1)
    assert "no checkpoint there" in capsys.readouterr().err


def test_an_impossible_configuration_is_printed_once_not_once_per_rank():
    proc = run(2, *MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
               "--global-batch-size", "3", check=False)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("pretrain_gpt.py: error: --global-batch-size=3") == 1


def test_a_split_part_with_no_documents_is_not_built_when_unused_and_refused_when_used(runs, corpus):
    """The shipped corpus has 27 documents: 949,50,1 leaves the test part none (it is never read);
    99,1,0 leaves validation none, which --eval-iters would read."""
    proc = ok(runs, "empty test split")
    assert "validation loss at iteration 2" in proc.stdout
    refused = runs[0]["empty validation split"]
    assert refused.returncode == 2 and not (runs[2] / "c").exists()
    assert refused.stderr.strip() == ("pretrain_gpt.py: error: --split=99,1,0: gives the validation part 0 of the "
                                      f"27 documents of {corpus[1]}; give it a larger share or set --eval-iters 0")


def test_train_samples_schedule_equals_the_iteration_one(runs):
    """--train-samples with the sample-based warmup and decay flags is the same run as iterations."""
    by_iters, by_samples = ok(runs, "by iterations"), ok(runs, "by samples")
    assert len(lrs(by_iters)) == 4 and lrs(by_samples) == lrs(by_iters)
    assert losses(by_samples) == losses(by_iters)


def test_resuming_with_another_lr_schedule_asserts_unless_told_which_wins(runs):
    ok(runs, "lr saved")
    changed = runs[0]["lr changed"]
    assert changed.returncode == 2
    assert changed.stderr.strip().startswith(f"pretrain_gpt.py: error: --lr=0.002: the checkpoint in {runs[2] / 'lr'} "
                                             "was trained with max_lr 0.001; pass --override-opt_param-scheduler")
    overridden = ok(runs, "lr overridden")
    assert lrs(overridden) == ["1.000000E-03", "5.000000E-04"]  # linear decay of 2e-3 over 4 iterations, at 2 and 3
    kept = ok(runs, "lr kept")
    assert lrs(kept) == ["5.000000E-04", "2.500000E-04"]  # the checkpoint's 1e-3


def test_exit_duration_in_mins_stops_once_that_long_has_passed():
    """Megatron-LM's --exit-duration-in-mins takes whole minutes: the policy is shown a start an hour ago."""
    policy = _ExitPolicy(ExitSpec(interval=None, signal_handler=False, signal=15, duration_in_mins=59))
    rt = SimpleNamespace(device=torch.device("cpu"), all_reduce=lambda tensor: None)
    assert policy.reason(1, rt) is None
    policy.start -= 3600
    assert policy.reason(2, rt) == "--exit-duration-in-mins 59"
