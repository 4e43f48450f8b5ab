"""Checkpointing sees named states, a CheckpointSpec and the process-group runtime, never the trainer
(issue 41): no function of megatron/chimera/checkpoint/ takes one, and none reads a field of Megatron-LM's
namespace; the spec reads the namespace once."""
import ast
import os

import pytest

from megatron.chimera.checkpoint.states import DataPosition
from megatron.chimera.config.arguments import parse_args
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
