"""Checkpointing sees named states, a CheckpointSpec and the process-group runtime, never the trainer
(issue 41): no function of megatron/chimera/checkpoint/ takes one, and none reads a field of Megatron-LM's
namespace; the spec reads the namespace once. The checkpoint flags of issue 42 that the spec carries. It
names no state (issue 51): any states, placed by states.py's PLACES, are saved where Megatron-LM keeps them
and loaded in the order their places declare, each part left out as Megatron-LM's flags say."""
import argparse
import ast
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from megatron.core.dist_checkpointing import validation
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from torch.distributed.checkpoint import FileSystemReader

from megatron.chimera.arguments import parse_args
from megatron.chimera.checkpoint import async_saves, checkpointing
from megatron.chimera.checkpoint.checkpointing import LATEST, _publish, load_checkpoint, read_common, save_checkpoint
from megatron.chimera.checkpoint.format import CheckpointError
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


def test_checkpointing_names_no_state():
    """States are taken from the mapping by the names layout.py orders, never by a name written here."""
    named = [f"{name}:{node.lineno}" for name, tree in _trees() if name != "states.py" for node in ast.walk(tree)
             if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "states"
             and isinstance(node.slice, ast.Constant)]
    assert named == [], f"checkpoint/ names states: {named}"


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
    (["--ckpt-format", "torch", "--use-distributed-optimizer"], 1, "Megatron-LM's distrib_optim.pt"),
    (["--ckpt-format", "torch", "--optimizer", "muon"], 1, "not --optimizer muon's: save torch_dist"),
    (["--ckpt-format", "torch", "--no-save-optim", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
      "interleaved", "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4", "--num-layers", "4"],
     2,
     "one stage per rank"),
    (["--verify-integrity", "--ckpt-format", "torch", "--no-save-optim"], 1, "needs --ckpt-format torch_dist")])
def test_what_the_torch_format_cannot_save_is_refused_before_start(tmp_path, capsys, flags, world, said):
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--save", str(tmp_path), "--save-interval", "5"] + flags, world_size=world)
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("flags, optimizer", [([], True), (["--no-save-optim"], False),
                                              (["--use-distributed-optimizer", "--no-save-optim"], False)])
def test_the_spec_says_what_a_save_writes(tmp_path, flags, optimizer):
    """--ckpt-format torch is written with the optimizer state unless --no-save-optim (which also lets the
    distributed optimizer save it)."""
    spec = CheckpointSpec.from_args(parse_args(TINY + ["--save", str(tmp_path), "--save-interval", "5", "--ckpt-format",
                                                       "torch"] + flags, world_size=1))
    assert (spec.format, spec.save_optimizer, spec.verify_integrity) == ("torch", optimizer, False), spec


@pytest.mark.parametrize("changed, dropped, said", [({"bf16": True}, (), "--bf16=False: the torch checkpoint in"),
                                                     ({"tensor_model_parallel_size": 2}, (),
                                                      "--tensor-model-parallel-size=1: the torch checkpoint in"),
                                                     ({}, ("optimizer",), "holds no optimizer state")])
def test_a_torch_checkpoints_optimizer_state_loads_in_the_sizes_and_precision_it_was_saved_in(tmp_path, capsys,
                                                                                             changed, dropped, said):
    """Before anything starts: a legacy file's optimizer state (checkpoint/legacy.py) is refused, in one line, when
    the checkpoint was saved at another tensor-parallel size or precision (its args ``changed``), or without it."""
    folder = tmp_path / "iter_0000001" / "mp_rank_00"
    folder.mkdir(parents=True)
    args = vars(checkpointing._saved_args(parse_args(TINY, world_size=1), 4))
    state = {"args": argparse.Namespace(**{**args, **changed}), "iteration": 1, "checkpoint_version": 3.0,
             "model": {}, "optimizer": {}}
    torch.save({k: v for k, v in state.items() if k not in dropped}, folder / "model_optim_rng.pt")
    (tmp_path / LATEST).write_text("1")
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--load", str(tmp_path)], world_size=1)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


class Weights:
    """A model placed at the top level, as ModelChunks: ``model0.weight``."""

    def __init__(self, log: list, value: float):
        self.log, self.weight = log, torch.full((2, 3), value)

    def sharded_state_dict(self, metadata=None) -> dict:
        return {"model0": {"weight": ShardedTensor.from_rank_offsets("weight", self.weight, replica_id=0)}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.log.append("model")
        self.weight.copy_(state_dict["model0"]["weight"])


class Moments:
    """An optimizer: a moment sharded like the model's weight, over the model's sharded state, and a step."""

    def __init__(self, log: list, value: float):
        self.log, self.moment, self.step = log, torch.full((2, 3), value), int(value)

    def sharded_state_dict(self, model_sharded_state_dict: dict, metadata=None) -> dict:
        self.log.append(("optimizer built over", sorted(model_sharded_state_dict), metadata))
        weight = model_sharded_state_dict["model0"]["weight"]
        return {"state": {"exp_avg": make_sharded_optimizer_tensor(weight, self.moment, "optimizer.state.exp_avg")},
                "step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.log.append("optimizer")
        self.moment.copy_(state_dict["state"]["exp_avg"])
        self.step = state_dict["step"]


class Generators:
    """Per-rank state, sharded by rank, as RNGState."""

    def __init__(self, log: list, value: float):
        self.log, self.state = log, torch.full((4,), value)

    def sharded_state_dict(self, metadata=None) -> dict:
        return {"torch": ShardedTensor.from_rank_offsets("rng_state.torch", self.state.unsqueeze(0), (0, 0, 1),
                                                         replica_id=0)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.log.append("rng")
        self.state.copy_(state_dict["torch"][0])


class Plain:
    """A state without tensors: an LR scheduler, a loss scale."""

    def __init__(self, log: list, name: str, value: float):
        self.log, self.name, self.value = log, name, {"value": value}

    def state_dict(self) -> dict:
        return dict(self.value)

    def load_state_dict(self, state_dict: dict) -> None:
        self.log.append(self.name)
        self.value = state_dict


def fakes(log: list, value: float) -> dict:
    """Every kind of state, those that come after others first: checkpointing orders them."""
    return {"grad_scaler": Plain(log, "grad_scaler", value), "optimizer": Moments(log, value),
            "lr_scheduler": Plain(log, "lr_scheduler", value), "rng": Generators(log, value),
            "model": Weights(log, value)}


RT = SimpleNamespace(world=1, tp=1, pp=1, dp=1, tp_rank=0, dp_rank=0, cp_rank=0, worker=0)


def spec_for(root, **changes) -> CheckpointSpec:
    spec = CheckpointSpec(save=str(root), save_interval=1, load=str(root), fresh_start=None, finetune=False,
                          load_optimizer=True, load_rng=True, strictness="assume_ok_unexpected", schedule="1f1b",
                          async_save=False, retain_interval=None, verify_integrity=False, format="torch_dist",
                          save_optimizer=True)
    return replace(spec, **changes)


def saved(root, **changes) -> str:
    """A checkpoint of the fakes (every value 3), iteration 2 after 4 samples."""
    return save_checkpoint(fakes([], 3.0), DataPosition(2, 2, 4), spec_for(root, **changes), RT,
                           argparse.Namespace(use_distributed_optimizer=False))


def test_each_state_is_saved_where_megatron_lm_keeps_it(one_process_group, tmp_path):
    folder = saved(tmp_path)
    common = read_common(folder, "torch_dist", str(tmp_path))
    assert (common["iteration"], common["args"].consumed_train_samples) == (2, 4), common
    assert common["opt_param_scheduler"] == {"value": 3.0}, common
    assert common["optimizer"] == {"step": 3, "grad_scaler": {"value": 3.0}}, common
    tensors = {key for key in FileSystemReader(folder).read_metadata().state_dict_metadata
               if not key.startswith("common_state")}  # megatron-core's object holding the common state
    assert tensors == {"weight", "optimizer.state.exp_avg.weight", "rng_state.torch"}, tensors


def test_states_load_in_the_order_their_places_declare(one_process_group, tmp_path):
    """The optimizer's sharded state is built over the model's, with what the checkpoint holds of it; the model
    loads before the optimizer (whose fp32 main weights replace those the model's load copied), the loss
    scale after the optimizer, whose dict holds it."""
    saved(tmp_path)
    log, position = [], DataPosition(2)
    states = fakes(log, 0.0)
    load_checkpoint(states, position, spec_for(tmp_path), RT)
    assert log[0] == ("optimizer built over", ["model0"], {"step": 3, "grad_scaler": {"value": 3.0}}), log
    loads = log[1:]
    assert sorted(loads) == ["grad_scaler", "lr_scheduler", "model", "optimizer", "rng"], log
    assert loads.index("model") < loads.index("optimizer") < loads.index("grad_scaler"), log
    assert (states["model"].weight == 3).all() and (states["optimizer"].moment == 3).all(), "tensors not loaded"
    assert (states["rng"].state == 3).all() and states["optimizer"].step == 3, "rng or step not loaded"
    assert (position.iteration, position.consumed_samples) == (2, 4), position


@pytest.mark.parametrize("changes, world, loaded", [
    ({"load_optimizer": False}, 1, ["model", "rng"]),
    ({"load_rng": False}, 1, ["grad_scaler", "lr_scheduler", "model", "optimizer"]),
    ({}, 2, ["grad_scaler", "lr_scheduler", "model", "optimizer"])])  # another layout: not the RNG states
def test_the_flags_leave_out_the_parts_megatron_lm_leaves_out(one_process_group, tmp_path, changes, world, loaded):
    saved(tmp_path)
    log = []
    rt = SimpleNamespace(**{**vars(RT), "world": world})
    load_checkpoint(fakes(log, 0.0), DataPosition(2), spec_for(tmp_path, **changes), rt)
    assert sorted(entry for entry in log if isinstance(entry, str)) == loaded, log


def test_without_save_optim_the_optimizers_part_is_not_saved(one_process_group, tmp_path):
    common = read_common(saved(tmp_path, save_optimizer=False), "torch_dist", str(tmp_path))
    assert "optimizer" not in common and "opt_param_scheduler" not in common, sorted(common)


def test_a_corrupted_checkpoint_loads_nothing(one_process_group, tmp_path):
    folder = saved(tmp_path)
    shard = next(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    log, position = [], DataPosition(2)
    with pytest.raises(CheckpointError, match="is corrupted") as failed:
        load_checkpoint(fakes(log, 0.0), position, spec_for(tmp_path), RT)
    assert "\n" not in str(failed.value) and log == [] and position.iteration == 0, (str(failed.value), log)


def test_verify_integrity_hashes_every_file_once_at_a_save_and_once_at_a_load(one_process_group, tmp_path,
                                                                             monkeypatch):
    """Each file is hashed once by whoever wrote it at a save (integrity.json from the same digests), and once
    at a load; megatron-core, which would hash every file again on rank 0, hashes none, and still verifies the
    integrity.json ours wrote."""
    hashed = []
    for module in (async_saves, checkpointing):
        monkeypatch.setattr(module, "digest", lambda path, real=module.digest: hashed.append(path) or real(path))
    monkeypatch.setattr(validation, "_compute_file_hash", lambda path: pytest.fail(f"megatron-core hashed {path}"))
    folder = saved(tmp_path, verify_integrity=True)
    files = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name != "manifest.json")
    assert sorted(path.replace(".tmp", "") for path in hashed) == files, f"hashed at the save: {hashed}"
    hashed.clear()
    load_checkpoint(fakes([], 0.0), DataPosition(2), spec_for(tmp_path, verify_integrity=True), RT)
    assert sorted(hashed) == files, f"hashed at the load: {hashed}"
    monkeypatch.undo()
    validation.verify_integrity_manifest(folder)
