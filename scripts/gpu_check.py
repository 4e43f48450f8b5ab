"""The first-GPU check: what the CPU test suite cannot show, in one command on a machine with GPUs.

    python scripts/gpu_check.py               # on a GPU machine: every check its GPU count allows
    python scripts/gpu_check.py --cpu-smoke   # anywhere: each check's CPU half (gloo), the rest skipped
    sbatch recipes/slurm/gpu_check_two_nodes.sbatch   # --nodes 2: each NCCL case spread over two nodes

Writes benchmarks/results/gpu_check.json (every check's status, reason, details and the commands it ran)
and prints one verdict line: PASS; INCOMPLETE (exit 3) when nothing failed but a part the job would use
could not be checked (Transformer Engine not installed, apex's kernels unusable); FAIL (exit 1). Each
check is independent: a failure is recorded and the next check runs. With one GPU the checks run our
executor on host-staged ranks (Transformer Engine's split backward, equality with one process, plan
mode with overlapped weight gathers, syncs, memory per action, the action clock, a layer's profile);
with two or more, NCCL runs of Chimera against one process (overlapped reductions and gathers,
Transformer Engine in bf16, MoE messages above NCCL's buffer), a save and resume, late communicators and
a timing against megatron-core's 1F1B. Each check, and how the launches are shared: docs/notes/gpu-check.md.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import date

import torch

from megatron.chimera.model.kernels import apex_missing, transformer_engine_usable
from megatron.chimera.testing.gpu_check import layer_profile, multi_gpu, single_gpu
from megatron.chimera.testing.gpu_check.launching import ROOT, Machine, result


def checks(m: Machine) -> list[tuple[str, object]]:
    found = [("te-split-backward", single_gpu.check_te_split_backward),
             ("executor-matches-one-process", single_gpu.check_executor_matches),
             ("split-backward-matches", single_gpu.check_split_backward_matches),
             ("bf16-distributed-optimizer", single_gpu.check_bf16_distributed_optimizer),
             ("plan-mode-matches-one-process", single_gpu.check_plan_mode_matches),
             ("plan-mode-overlapped-gather-matches-one-process", single_gpu.check_plan_mode_overlapped_gather),
             ("apex-kernels", single_gpu.check_apex_kernels),
             ("memory-per-action", single_gpu.check_memory_per_action),
             ("action-clock", single_gpu.check_action_clock),
             ("layer-profile", layer_profile.check_layer_profile)]
    found += [(case.name, functools.partial(multi_gpu.check_case, case=case)) for case in multi_gpu.cases(m)]
    found += [("eval-save-resume", multi_gpu.check_eval_save_resume),
              ("no-late-communicators", multi_gpu.check_no_late_communicators),
              ("nccl-across-nodes", multi_gpu.check_across_nodes),
              ("no-sync-in-forward-backward", lambda m: single_gpu.check_no_sync(m, multi_gpu.nccl_runs(m))),
              ("timed-against-megatron-1f1b", multi_gpu.check_timed_against_1f1b)]
    return found


def run_check(name: str, check, m: Machine) -> dict:
    """The check's result; an exception (or a parser's exit) is the check's failure, not the script's.
    What a check prints in this process (Megatron's argument banner) goes to stderr: stdout is the
    verdict line."""
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            found = check(m)
    except (Exception, SystemExit) as e:
        message = str(e).strip().splitlines()
        found = result("fail", f"{type(e).__name__}: {message[-1] if message else ''}",
                       traceback=traceback.format_exc()[-3000:])
    found = {"name": name, **found, "seconds": round(time.monotonic() - start, 1)}
    print(f"{name}: {found['status']}: {found['reason']} ({found['seconds']} s)", file=sys.stderr, flush=True)
    return found


def verdict(results: list[dict]) -> str:
    failed = [r for r in results if r["status"] == "fail"]
    if failed:
        more = f" (and {len(failed) - 1} more failed)" if len(failed) > 1 else ""
        return f"gpu_check: FAIL: {failed[0]['name']}: {failed[0]['reason']}{more}"
    passed = sum(r["status"] == "pass" for r in results)
    skipped = [r["reason"] for r in results if r["status"] == "skipped"]
    why = f", {len(skipped)} skipped: {'; '.join(dict.fromkeys(skipped))}" if skipped else ""
    measured = [f"{r['name']}: {r['reason']}" for r in results if r["status"] == "measured"]
    why += f"; measured, not judged: {'; '.join(measured)}" if measured else ""
    unchecked = [f"{r['name']}: {r['reason']}" for r in results if r["status"] == "incomplete"]
    if unchecked:
        return f"gpu_check: INCOMPLETE ({passed} checks passed{why}; unchecked: {'; '.join(unchecked)})"
    return f"gpu_check: PASS ({passed} checks passed{why})"


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="The first-GPU check (see this file's docstring).")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="without a GPU: run each check's CPU half (gloo, emulated NCCL); GPU-only checks skip")
    parser.add_argument("--nodes", type=int, default=1,
                        help="spread each NCCL case's ranks evenly over this many nodes of the Slurm allocation it "
                             "runs in, one srun step per launch (recipes/slurm/gpu_check_two_nodes.sbatch)")
    parser.add_argument("--out", help="the JSON to write (default benchmarks/results/gpu_check.json, "
                                      "gpu_check_<N>_nodes.json with --nodes N; with --cpu-smoke, "
                                      "gpu_check_cpu_smoke.json in the temporary directory)")
    parser.add_argument("--interconnect-worker", metavar="JSON", help=argparse.SUPPRESS)  # layer_profile's
    found = parser.parse_args()
    if found.nodes > 1 and (found.cpu_smoke or "SLURM_JOB_ID" not in os.environ):
        parser.error(f"--nodes {found.nodes} starts its NCCL cases with srun: run it inside a Slurm allocation of "
                     "that many nodes, without --cpu-smoke (sbatch recipes/slurm/gpu_check_two_nodes.sbatch)")
    return found


def main() -> None:
    given = options()
    if given.interconnect_worker:
        layer_profile.interconnect_worker(given.interconnect_worker)
        return

    if not given.cpu_smoke and not torch.cuda.is_available():
        sys.exit("gpu_check: FAIL: no GPU here (torch.cuda.is_available() is False); --cpu-smoke exercises the "
                 "script on the CPU")
    written = "gpu_check.json" if given.nodes == 1 else f"gpu_check_{given.nodes}_nodes.json"
    out = given.out or (os.path.join(tempfile.gettempdir(), "gpu_check_cpu_smoke.json") if given.cpu_smoke
                        else os.path.join(ROOT, "benchmarks", "results", written))
    start = time.monotonic()
    # across nodes every rank writes its report (and checkpoints) where the first node reads them
    with tempfile.TemporaryDirectory(prefix=".gpu_check.", dir=ROOT if given.nodes > 1 else None) as workdir:
        gpus = 0 if given.cpu_smoke else torch.cuda.device_count()
        m = Machine(given.cpu_smoke, gpus, transformer_engine_usable(), apex_missing(), workdir, given.nodes)
        results = [run_check(name, check, m) for name, check in checks(m)]
    line = verdict(results)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"verdict": line, "date": str(date.today()), "mode": "cpu-smoke" if given.cpu_smoke else "gpu",
                   "device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus, "nodes": m.nodes,
                   "transformer_engine": m.te, "apex_missing": m.apex, "torch": torch.__version__,
                   "seconds": round(time.monotonic() - start, 1), "checks": results}, f, indent=1)
    print(f"{line} [{os.path.relpath(out, ROOT) if out.startswith(ROOT) else out}]")
    sys.exit(1 if line.startswith("gpu_check: FAIL") else 3 if "INCOMPLETE" in line else 0)


if __name__ == "__main__":
    main()
