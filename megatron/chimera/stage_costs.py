"""Stage costs measured on the run's own devices: what ``--pipeline-schedule auto`` plans with when no
``--pipeline-profile`` is given, and what ``python -m megatron.chimera.profile`` writes to a file.

Each rank builds the same few small one-process models of the user's model (its flags, with fewer layers,
no parallelism, and an expert-parallel rank's share of the experts) and times a forward and a backward of
each at every micro-batch size the plan may pick (model/stage_timing.py). From their differences come the
parts a stage is made of (chimera_schedules/tools/stage_profile.py):

    one   = 1 dense layer              = output + layer
    three = 3 dense layers             = output + 3 layer
    moe   = 1 dense and 2 MoE layers   = output + layer + 2 moe_layer        (models with experts)
    mtp   = the last layer's kind, MTP = output + last + mtp                 (models with MTP)

The ranks then take the median of every number (one all-gather), so that every rank plans from the same
costs and picks the same plan. It runs before the trainer starts: in a launched run it makes the default
process group as the trainer would (distributed/process_groups.py, which the trainer then keeps), outside
one a group of its own for the moment it measures.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from chimera_schedules.tools.stage_profile import PassTimes, StageProfile

from .config.auto_plan import value, without
from .config.job import job_config
from .config.run_plan import make_run_plan
from .distributed.ports import free_port
from .distributed.process_groups import init_distributed
from .model import cpu_compat
from .model.stage_timing import pass_times

REPEATS = 5
# the user's flags that split the model or set its layer pattern, MTP and experts: each small model sets its own
SET_HERE = ("--num-layers", "--moe-layer-freq", "--mtp-num-layers", "--num-experts", "--moe-router-topk",
            "--moe-router-num-groups", "--moe-router-group-topk", "--expert-tensor-parallel-size",
            "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers", "--num-layers-per-virtual-pipeline-stage",
            "--num-virtual-stages-per-pipeline-rank")
SWITCHES = ("--sequence-parallel", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
OneProcess = Callable[[list[str]], argparse.Namespace]  # flags -> the validated namespace of them on one process


def measure(argv: list[str], run: argparse.Namespace, one_process: OneProcess, sizes: list[int]) -> StageProfile:
    """The parts' times of the model ``argv`` describes (``run``: a validated namespace of it), at each micro-batch
    size of ``sizes``, agreed by every rank. ``one_process(flags)`` validates a one-process command line
    (ConfigError if refused)."""
    models = small_models(argv, run, one_process)
    dims = job_config(next(iter(models.values()))[0]).parallel
    with _one_process_views(dims) as (device, world):
        local = {name: pass_times(job_config(args).model, _plan(args), device, sizes, args.seq_length,
                                  args.padded_vocab_size, REPEATS) for name, (args, _) in models.items()}
        agreed = _median_over_ranks(local, world)
    last_is_moe = next(last for _, last in models.values())
    times = {b: _parts({name: agreed[name][b] for name in models}, last_is_moe) for b in sizes}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return StageProfile(f"measured on {where}", f"{world} rank(s) ({where}), the fastest of {REPEATS} passes per rank, "
                        "then of the ranks", times)


def small_models(argv: list[str], whole: argparse.Namespace,
                 one_process: OneProcess) -> dict[str, tuple[argparse.Namespace, bool]]:
    """name -> (the validated one-process namespace, whether the model's last layer is MoE), for each small
    model the kinds of part of the model ``whole`` need."""
    model = without(without(argv, SET_HERE), SWITCHES, valued=False)
    experts = []
    if whole.num_experts:
        local = max(1, whole.num_experts // int(value(argv, "--expert-model-parallel-size") or 1))
        experts = ["--num-experts", str(local), "--moe-router-topk", str(min(whole.moe_router_topk, local))]
    freq = whole.moe_layer_freq
    last_is_moe = bool(whole.num_experts) and (bool(freq[-1]) if isinstance(freq, list)
                                                else (whole.num_layers - 1) % freq == 0)

    def small(pattern: list[int], mtp: int = 0) -> argparse.Namespace:
        layers = experts + ["--moe-layer-freq", str(pattern).replace(" ", "")] if experts else []
        flags = ["--num-layers", str(len(pattern))] + layers
        return one_process(model + flags + (["--mtp-num-layers", str(mtp)] if mtp else []))

    out = {"one": small([0]), "three": small([0, 0, 0])}
    if experts:
        out["moe"] = small([0, 1, 1])
    if whole.mtp_num_layers:
        out["mtp"] = small([int(last_is_moe)], mtp=1)
    return {name: (args, last_is_moe) for name, args in out.items()}


def _plan(args: argparse.Namespace):
    job = job_config(args)
    return make_run_plan(job.pipeline, job.parallel)


def _parts(t: dict[str, tuple[float, float]], last_is_moe: bool) -> dict[str, PassTimes]:
    """The parts from the small models' times (the differences in the module's docstring), none below 0."""
    one, three = PassTimes(*t["one"]), PassTimes(*t["three"])
    layer = _floor((three + one * -1) * 0.5)
    output = _floor(one + layer * -1)
    parts = {"layer": layer, "output": output}
    if "moe" in t:
        parts["moe_layer"] = _floor((PassTimes(*t["moe"]) + one * -1) * 0.5)
    if "mtp" in t:
        last = parts["moe_layer"] if last_is_moe else layer
        parts["mtp"] = _floor(PassTimes(*t["mtp"]) + output * -1 + last * -1)
    return parts


def _floor(t: PassTimes) -> PassTimes:
    return PassTimes(max(t.forward, 0.0), max(t.backward, 0.0))


def _median_over_ranks(local: dict, world: int) -> dict:
    """Every rank's numbers, the median of each: the same on every rank."""
    if world == 1:
        return local
    every = [None] * world
    dist.all_gather_object(every, local)
    return {name: {b: tuple(statistics.median(r[name][b][i] for r in every) for i in range(2)) for b in times}
            for name, times in local.items()}


@contextlib.contextmanager
def _one_process_views(dims):
    """(device, world size): every rank its own one-process megatron-core state while it measures. In a launched
    run the default process group is the trainer's own (made here as it makes it, and kept); outside a launch,
    a lone group for the measurement only. The megatron-core state found is given back."""
    lone = "RANK" not in os.environ and not dist.is_initialized()
    if lone:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cpu":
            cpu_compat.apply()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    else:
        device = init_distributed(dims.backend, dims.timeout_minutes, dims.p2p_host_staging)[1]
    found = {name: held for name, held in vars(parallel_state).items() if name.startswith("_")
             and name.lstrip("_")[:1].isupper()}  # its groups, ranks and sizes, kept at module level
    for name, held in found.items():  # as freshly imported (None, or an empty dict), the groups found left alive
        setattr(parallel_state, name, {} if isinstance(held, dict) else None)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield device, dist.get_world_size()
    finally:
        for name, held in found.items():
            setattr(parallel_state, name, held)
        if lone:
            dist.destroy_process_group()
