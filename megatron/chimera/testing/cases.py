"""Several pretraining runs in one launch: each case is ``pretrain_gpt.py``'s flags, run in turn by the
same processes, so a suite pays for one torchrun start and one megatron import per launch instead of
one per case (about 5 s and 0.9 GB per process on this project's CI machine).

    torchrun --nproc_per_node 2 -m megatron.chimera.testing.cases --cases CASES.json --out DIR

CASES.json maps a case's name to its flags (``pretrain_gpt.py`` first is allowed and dropped). This
program creates the process group once and passes it to every case, so ``pretrain`` leaves it alive
between cases; each case starts from the launch's environment variables and garbage collector. Each
rank writes what a case printed, stdout and stderr at the file-descriptor level, to
``DIR/<case index>.<rank>.out`` and ``.err``, and rank 0 writes ``DIR/<case index>.rc``: 0, or the exit
code the case's ``SystemExit`` carried. A configuration that ``parse_args`` refuses (exit code 2,
nothing started) lets the next case run; any other failure ends the launch, since the ranks may
disagree about where they stopped: the cases after it are not run (they have no ``.rc``). The ranks
agree on each case's code (the worst one) before going on. A case that saved is loaded by a later one
in the same processes, through a new ``pretrain``: a resume that must be a new launch is not a case.

Tests call ``run_cases``, which launches this and returns one ``CompletedProcess`` per case, its
output the ranks' files in rank order, as a launch of that case alone would have printed it.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.chimera import parse_args, pretrain
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.testing.launch import launch
from megatron.chimera.testing.parsing import read_field_docstrings_once


def run_cases(nproc: int, cases: dict[str, list[str]], timeout: int = 900) -> dict[str, subprocess.CompletedProcess]:
    """Run every case in one launch of ``nproc`` processes; a case that did not finish (it crashed, or
    the launch ended before it) has return code None."""
    with tempfile.TemporaryDirectory(prefix="chimera-cases-") as out:
        path = os.path.join(out, "cases.json")
        with open(path, "w") as f:
            json.dump(cases, f)
        proc = launch(nproc, "-m", "megatron.chimera.testing.cases", "--cases", path, "--out", out, timeout=timeout)
        return {name: _collect(out, i, name, nproc, proc) for i, name in enumerate(cases)}


def _launch_failed(launch_proc) -> str:
    return f"[the launch exited {launch_proc.returncode}]\n" + launch_proc.stdout[-3000:] + launch_proc.stderr[-5000:]


def _collect(out: str, index: int, name: str, nproc: int, launch_proc) -> subprocess.CompletedProcess:
    def read(suffix: str) -> str:
        parts = []
        for rank in range(nproc):
            path = os.path.join(out, f"{index}.{rank}.{suffix}")
            if os.path.exists(path):
                with open(path) as f:
                    parts.append(f.read())
        return "".join(parts)

    rc_path = os.path.join(out, f"{index}.rc")
    returncode = None
    if os.path.exists(rc_path):
        with open(rc_path) as f:
            returncode = int(f.read())
    stderr = read("err")
    if returncode is None:  # what the launch itself said, for the failing test's message
        stderr += f"\n[case {name!r} did not finish] " + _launch_failed(launch_proc)
    elif returncode == 0 and launch_proc.returncode != 0:  # e.g. an abort while the processes tore down
        returncode = launch_proc.returncode
        stderr += "\n" + _launch_failed(launch_proc)
    return subprocess.CompletedProcess([name], returncode, read("out"), stderr)


@contextlib.contextmanager
def _output_to(stem: str):
    """Send this process's stdout and stderr, Python's and the C++ libraries' alike, to ``stem``.out/.err."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stem + ".out", "w") as out, open(stem + ".err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


@contextlib.contextmanager
def process_state_kept():
    """What a run may change for its whole process and a launch of its own would not pass on: the
    environment (megatron-core sets NVTE_*_ATTN for the attention backend it builds, --deterministic-mode
    NCCL_ALGO and others), torch's deterministic algorithms (--deterministic-mode) and the garbage
    collector (--manual-gc turns it off). Each case starts from the launch's."""
    environment, collecting = dict(os.environ), gc.isenabled()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        for key, value in environment.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        (gc.enable if collecting else gc.disable)()


def _run_one(flags: list[str]) -> tuple[int, bool]:
    """One case as ``pretrain_gpt.py`` runs it: its exit code, and whether the launch can go on. A
    configuration refused by ``parse_args`` stops every rank alike before anything starts, so the next
    case can run; a failure after that may leave the ranks out of step, so it ends the launch."""
    if flags and flags[0].endswith("pretrain_gpt.py"):
        flags = flags[1:]
    try:
        args = parse_args(flags)
    except SystemExit as e:
        return _exit_code(e), True
    try:
        pretrain(args, forward_step)
    except SystemExit as e:
        return _exit_code(e), False
    return 0, True


def _exit_code(e: SystemExit) -> int:
    """What the process would have exited with: None is success, a message is failure."""
    if e.code is None:
        return 0
    return e.code if isinstance(e.code, int) else 1


def _agreed(code: int, go_on: bool) -> tuple[int, bool]:
    """The case's exit code and whether to go on, the same on every rank: the worst code any rank saw,
    and go on only if every rank can (a collective, so no rank waits at a barrier another has left)."""
    verdict = torch.tensor([code, int(not go_on)])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    return int(verdict[0]), not verdict[1]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron.chimera.testing.cases")
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    with open(options.cases) as f:
        cases = json.load(f)
    if "RANK" not in os.environ:  # a lone process, as pretrain_gpt.py runs without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    # gloo: the launcher runs the suite's CPU cases; each case's own groups take its flags' timeout
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank = dist.get_rank()
    read_field_docstrings_once()
    for index, flags in enumerate(cases.values()):
        with _output_to(os.path.join(options.out, f"{index}.{rank}")), process_state_kept():
            code, go_on = _agreed(*_run_one(flags))
        if rank == 0:
            with open(os.path.join(options.out, f"{index}.rc"), "w") as f:
                f.write(str(code))
        if not go_on:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
