"""How long a checkpoint save and load take against the checkpoint's size, with 1 and with 4 writers.

    python -m benchmarks.checkpoint_io [--sizes 64,256,1024] [--writers 1,4] [--integrity-sizes 1024]
                                       [--repeats 3] [--label after]

For each number of writers, that many CPU processes (gloo) save and load a synthetic model-sized state
(16 weight matrices of SIZE MB in all, each split over the processes by rows) through the trainer's own
save_checkpoint and load_checkpoint (torch_dist, no optimizer state): megatron-core writes the files, the
digests are taken, the manifest is published, and the load verifies every file before reading it; the
--integrity-sizes again with --verify-integrity (megatron-core's integrity.json too). Times are wall seconds
on rank 0 from a barrier before the call to a barrier after it, the fastest of --repeats, and the CPU
seconds rank 0's process spent in the call (its share of the hashing among them); the files sit in a
fresh folder under the system's temporary directory (so a load reads them from the page cache) and are
removed after each save and load. The results go to benchmarks/results/checkpoint_io.json under ``--label``
(the other labels there are kept, so a run before a change and one after it sit side by side).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron.chimera.checkpoint.checkpointing import load_checkpoint, save_checkpoint
from megatron.chimera.checkpoint.states import DataPosition, RNGState
from megatron.chimera.config.checkpoint_spec import CheckpointSpec
from megatron.chimera.distributed.ports import free_port
from megatron.chimera.model import cpu_compat

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint_io.json")
MATRICES, COLUMNS = 16, 1024


class Weights:
    """A model-sized state: MATRICES fp32 matrices of ``nbytes`` in all, rank ``rank`` of ``world`` holding
    its rows of each, saved under a model's key (``model0``) as megatron-core's sharded tensors."""

    def __init__(self, nbytes: int, rank: int, world: int):
        rows = max(world, nbytes // (4 * COLUMNS * MATRICES) // world * world)
        self.rank, self.world = rank, world
        generator = torch.Generator().manual_seed(rank)
        self.matrices = [torch.randn(rows // world, COLUMNS, generator=generator) for _ in range(MATRICES)]

    def sharded_state_dict(self, metadata=None) -> dict:
        return {"model0": {f"layer{i}.weight": ShardedTensor.from_rank_offsets(
            f"layer{i}.weight", m, (0, self.rank, self.world), replica_id=0) for i, m in enumerate(self.matrices)}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict["model0"]  # compared after the load is timed

    def loaded_whole(self) -> bool:
        return all(torch.equal(self.loaded[f"layer{i}.weight"], m) for i, m in enumerate(self.matrices))

    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.matrices) * self.world


def _spec(root: str, integrity: bool) -> CheckpointSpec:
    return CheckpointSpec(save=root, save_interval=1, load=root, fresh_start=None, finetune=False,
                          load_optimizer=False, load_rng=True, strictness="assume_ok_unexpected", schedule="1f1b",
                          async_save=False, retain_interval=None, verify_integrity=integrity, format="torch_dist",
                          save_optimizer=False)


def _timed(call) -> tuple[float, float]:
    """Wall seconds from a barrier before ``call`` to one after it, and the CPU seconds of this process in it."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    call()
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - start, cpu


def _measure(rank: int, world: int, case: tuple[int, bool], root: str, repeats: int) -> dict:
    """One size, with or without --verify-integrity: the fastest of ``repeats`` saves and of as many loads of a
    fresh state, timed on rank 0 (the fastest: the machine is shared, and others' work only adds time)."""
    mb, integrity = case
    weights = Weights(mb << 20, rank, world)
    states = {"model": weights, "rng": RNGState(rank, world)}
    rt = SimpleNamespace(rank=rank, world=world, tp=1, pp=1, dp=world, tp_rank=0, dp_rank=rank, cp_rank=0, worker=0)
    spec, megatron_args = _spec(root, integrity), argparse.Namespace(use_distributed_optimizer=False)
    saves, loads = [], []
    for _ in range(repeats):
        saves.append(_timed(lambda: save_checkpoint(states, DataPosition.after(1, 1), spec, rt, megatron_args)))
        position = DataPosition(1)
        loads.append(_timed(lambda: load_checkpoint(states, position, spec, rt)))
        assert position.iteration == 1 and weights.loaded_whole(), "the checkpoint did not load back"
        if rank == 0:
            shutil.rmtree(root)
    fastest = {f"{what}{unit}": round(min(t[i] for t in times), 2) for what, times in (("save", saves), ("load", loads))
               for i, unit in enumerate(("_s", "_rank0_cpu_s"))}
    return {"writers": world, "megabytes": round(weights.nbytes() / 2**20), "verify_integrity": integrity, **fastest}


def _process(rank: int, world: int, port: int, cases: list, root: str, repeats: int) -> None:
    """One rank: every case in turn, in ``root``; rank 0 leaves the rows in ``root``/rows.json."""
    cpu_compat.apply()  # megatron-core's writer as the trainer runs it on the CPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = [_measure(rank, world, case, os.path.join(root, "checkpoint"), repeats) for case in cases]
    if rank == 0:
        with open(os.path.join(root, "rows.json"), "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _run(world: int, cases: list, repeats: int) -> list[dict]:
    root = tempfile.mkdtemp(prefix="checkpoint-io-")
    try:
        mp.start_processes(_process, args=(world, free_port(), cases, root, repeats), nprocs=world,
                           start_method="spawn")
        with open(os.path.join(root, "rows.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(root)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024", help="checkpoint sizes, MB")
    parser.add_argument("--writers", default="1,4", help="numbers of processes")
    parser.add_argument("--integrity-sizes", default="1024", help="sizes measured again with --verify-integrity")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per case; the fastest is kept")
    parser.add_argument("--label", default="after", help="the key the results are stored under")
    args = parser.parse_args(argv)
    cases = [(int(mb), False) for mb in args.sizes.split(",")]
    cases += [(int(mb), True) for mb in args.integrity_sizes.split(",") if mb]
    rows = [row for w in args.writers.split(",") for row in _run(int(w), cases, args.repeats)]
    for row in rows:
        print(f"{row['writers']} writer(s) {row['megabytes']:6d} MB{' --verify-integrity' * row['verify_integrity']}:"
              f" save {row['save_s']:6.2f} s (rank 0's CPU {row['save_rank0_cpu_s']:5.2f} s),"
              f" load {row['load_s']:6.2f} s (rank 0's CPU {row['load_rank0_cpu_s']:5.2f} s)", flush=True)
    results = {}
    if os.path.isfile(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    results[args.label] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0], "rows": rows}
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
