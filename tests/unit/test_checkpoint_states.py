"""Checkpointing sees named states, a CheckpointSpec and the process-group runtime, never the trainer
(issue 41): no function of megatron/chimera/checkpoint/ takes one, and none reads a field of Megatron-LM's
namespace; the spec reads the namespace once. The checkpoint flags of issue 42 that the spec carries."""
import ast
import os

import pytest

from megatron.chimera.arguments import parse_args
from megatron.chimera.checkpoint.checkpointing import LATEST, _publish
from megatron.chimera.checkpoint.states import DataPosition
from megatron.chimera.config.checkpoint_spec import CheckpointSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKPOINT = os.path.join(ROOT, "megatron", "chimera", "checkpoint")
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--eval-iters", "0"]


def _trees():
    for name in sorted(os.listdir(CHECKPOINT)):
        if name.endswith(".py"):
            with open(os.path.join(CHECKPOINT, name)) as f:
                yield name, ast.parse(f.read())


def test_no_checkpoint_function_takes_the_trainer_or_reads_the_namespace():
    wrong = []
    for name, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.Lambda)):
                wrong += [f"{name}: {getattr(node, 'name', 'lambda')}({a.arg})" for a in node.args.args
                          if a.arg in ("trainer", "args")]
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in ("trainer", "args"):
                wrong.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert wrong == [], f"checkpoint/ reaches into the trainer or the namespace: {wrong}"


@pytest.mark.parametrize("flags, optimizer, rng", [([], True, True), (["--no-load-optim"], False, True),
                                                   (["--no-load-rng"], True, False), (["--finetune"], False, False)])
def test_the_spec_says_what_a_load_restores(tmp_path, flags, optimizer, rng):
    spec = CheckpointSpec.from_args(parse_args(TINY + ["--save", str(tmp_path), "--save-interval", "5"] + flags,
                                               world_size=1))
    assert (spec.load_optimizer, spec.load_rng, spec.finetune) == (optimizer, rng, "--finetune" in flags), spec
    where = (spec.save, spec.save_interval, spec.load, spec.strictness)
    assert where == (str(tmp_path), 5, None, "assume_ok_unexpected"), spec


def test_a_data_position_without_a_record_of_samples_counts_full_batches():
    position = DataPosition(global_batch_size=8)
    position.load_state_dict({"iteration": 3})
    assert (position.iteration, position.consumed_samples) == (3, 24), position
    position.load_state_dict({"iteration": 3, "consumed_samples": 20})  # a batch-size ramp-up
    assert position.consumed_samples == 20, position
    assert DataPosition.after(3, 8).state_dict() == {"iteration": 3, "consumed_samples": 24}


@pytest.mark.parametrize("flags, async_save", [(["--async-save", "--use-persistent-ckpt-worker"], True),
                                               (["--async-save"], False)])
def test_async_save_reaches_the_spec_only_with_the_persistent_worker_flag(tmp_path, flags, async_save):
    """As in Megatron-LM, whose validate_args turns --async-save off (with a warning) without
    --use-persistent-ckpt-worker."""
    spec = CheckpointSpec.from_args(parse_args(TINY + ["--save", str(tmp_path), "--save-interval", "2",
                                                       "--save-retain-interval", "4"] + flags, world_size=1))
    assert (spec.async_save, spec.retain_interval) == (async_save, 4), spec


def test_save_retain_interval_removes_the_previous_checkpoint_unless_a_multiple(tmp_path):
    """Megatron-LM's --save-retain-interval: publishing a checkpoint removes the one the latest file named
    before, unless its iteration is a multiple of the interval (saves every 2, retained every 4)."""
    for iteration in (2, 4, 6, 8):
        tmp = tmp_path / f"iter_{iteration:07d}.tmp"
        tmp.mkdir()
        (tmp / "__0_0.distcp").write_text("x")
        _publish(str(tmp), str(tmp_path / f"iter_{iteration:07d}"), str(tmp_path), iteration, 4)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", "iter_0000008", LATEST]
    assert (tmp_path / LATEST).read_text() == "8"


@pytest.mark.parametrize("flags, world, said", [
    (["--ckpt-format", "torch"], 1, "add --no-save-optim"),
    (["--ckpt-format", "torch", "--no-save-optim", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
      "interleaved", "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4", "--num-layers", "4"],
     2,
     "one stage per rank"),
    (["--verify-integrity", "--ckpt-format", "torch", "--no-save-optim"], 1, "needs --ckpt-format torch_dist")])
def test_what_the_torch_format_cannot_save_is_refused_before_start(tmp_path, capsys, flags, world, said):
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--save", str(tmp_path), "--save-interval", "5"] + flags, world_size=world)
    assert said in capsys.readouterr().err


def test_the_spec_says_what_a_save_writes(tmp_path):
    spec = CheckpointSpec.from_args(parse_args(TINY + ["--save", str(tmp_path), "--save-interval", "5", "--ckpt-format",
                                                       "torch", "--no-save-optim"], world_size=1))
    assert (spec.format, spec.save_optimizer, spec.verify_integrity) == ("torch", False, False), spec
