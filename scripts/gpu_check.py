"""The first-GPU check: what the CPU test suite cannot show, in one command on a machine with GPUs.

    python scripts/gpu_check.py               # on a GPU machine: every check its GPU count allows
    python scripts/gpu_check.py --cpu-smoke   # anywhere: the same orchestration on the CPU (gloo)

Writes benchmarks/results/gpu_check.json (every check's result and the commands it ran) and prints one verdict
line; exits non-zero when a check fails. Each check is independent: a failure is recorded and the next
check runs. Training comparisons use a tiny GPT (TINY: vocab 128, 4 layers, hidden 64, sequence 64, mock
data, no dropout, no biases) for ITERS iterations, launched through scripts/gpu_check_pretrain.py
(pretrain_gpt.py with an observer on the hooks protocol); a shared GPU's 2 ranks talk over gloo
through host memory (--p2p-host-staging), since NCCL refuses two ranks on one device.

One GPU:
1. te-refuses-split-backward: --split-backward with Transformer Engine layers (the default on a GPU
   where TE is installed) exits non-zero before anything starts, with one error line naming
   --transformer-impl and nothing written: TE's fused linears cannot separate the input and weight
   gradients, and silently training unsplit would be worse than refusing.
2. split-backward-matches: Chimera D=2 --split-backward equals Chimera D=2 unsplit (local layers, 2
   host-staged ranks), 1e-5 relative in every loss: splitting reorders work, never results. 1e-5, not
   the CPU suite's 1e-6, since GPU kernels may reduce in another order.
3. bf16-distributed-optimizer: Chimera D=2 --bf16 --use-distributed-optimizer, host-staged, against one
   bf16 process with the distributed optimizer. This is megatron/chimera/testing/equivalence.py's "chimera bf16
   D=2" case with its model (MODEL, whose loss condition number the bound's premise measured) and its
   bound, TOLERANCE["bf16"][0] = ITERS x u (u = 2^-8; derived there), imported, not copied.
4. no-sync-in-forward-backward: torch.cuda.set_sync_debug_mode("error") from the hooks'
   before_iteration to after_backward, so a host synchronisation inside forward_backward raises and
   fails the run (reported: the innermost frame and the exception's line); a sync stalls the pipeline,
   which the CPU cannot show. That mode does not see explicit waits (torch.cuda.synchronize,
   Event.synchronize): those are listed with their call sites under "explicit_waits", not failed, since
   a wait after the flush (the executor's action clock) is by design. On one GPU a one-process run
   (host staging copies to the host by design; at one stage the schedule is megatron-core's own, so
   the frame says whose sync it is); with 2 or more GPUs also every NCCL Chimera run below.
5. memory-flat: torch.cuda.max_memory_allocated() at every hook of a Chimera D=2 run (host-staged on
   one GPU, the NCCL run with 2 or more) does not grow after iteration 2 by more than 1 MiB or 0.5%: a
   leak (a held activation or message) shows as steady growth.
6. layer-profile: one GPT-2 1.3B layer's forward and backward (bf16, CUDA events) as a planner profile,
   profiles/gpu-<device>-<date>.json, which the planner must load and plan with. Interconnect numbers
   are measured (NCCL p2p ping-pong of one activation, all-reduce between 2 GPUs) or, with one GPU,
   listed under "unmeasured" and written as zero latency and infinite bandwidth (Infinity, which
   Python's json and the planner's Profile.load read), never borrowed from another machine.
Two or more GPUs (NCCL, CUDA_DEVICE_MAX_CONNECTIONS=1, --distributed-timeout-minutes 2 and a launch
timeout, so a hang fails its check instead of the script):
7. nccl chimera D=2 / D=4 (D=4 needs 4 GPUs): plain, --split-backward (local layers), the distributed
   optimizer, and TP=2 with --sequence-parallel (D x 2 GPUs), each against one fp32 process with the
   same layers, 1e-5 relative in every loss (as check 2).
A check the GPU count does not allow is "skipped" with the reason. --cpu-smoke hides any GPU, drops
host staging (it needs CUDA) and runs checks 2 and 3 over gloo; the GPU-only checks skip ("no GPU").
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import date

from megatron.chimera.distributed.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAUNCHER = os.path.join(ROOT, "scripts", "gpu_check_pretrain.py")
ITERS = 6
FP32_RTOL = 1e-5
LAUNCH_TIMEOUT_S = 180  # past the 2-minute process-group timeout, so a hang ends in a failed collective first
COMMON = ["--log-interval", "1", "--distributed-timeout-minutes", "2"]
TINY = ["--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--num-layers", "4",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear", "--eval-iters", "0", *COMMON]
LOCAL = ["--transformer-impl", "local"]
DISTOPT = ["--use-distributed-optimizer"]
MIB = 2 ** 20
GPT2_1_3B = dict(layers=64, hidden=1280, heads=20, seq=632, vocab=50257)  # the paper's GPT-2 1.3B, micro-batch 1
INTERCONNECT = ("p2p_latency", "p2p_bandwidth", "allreduce_latency", "allreduce_bandwidth")


@dataclass
class Machine:
    """What the checks run on, and the training runs launched so far (checks share identical runs)."""
    smoke: bool
    gpus: int
    te: bool
    workdir: str
    runs: dict = field(default_factory=dict)

    @property
    def staging(self) -> list[str]:
        return [] if self.smoke else ["--p2p-host-staging"]

    def need(self, gpus: int) -> str | None:
        """Why a check needing ``gpus`` GPUs cannot run here, or None."""
        if self.gpus == 0:
            return "no GPU"
        return f"needs {gpus} GPUs" if self.gpus < gpus else None


@dataclass
class Run:
    command: str
    rc: int | None  # None: killed at LAUNCH_TIMEOUT_S
    iters: int
    losses: list[float]
    reports: list[dict]
    tail: str

    def failure(self) -> str | None:
        """Why this run has no losses to compare, or None."""
        raised = [r["forward_backward_error"] for r in self.reports if r.get("forward_backward_error")]
        if raised:
            return f"raised inside forward_backward at {raised[0]['where']}: {raised[0]['last_line']}"
        if self.rc is None:
            return f"killed after {LAUNCH_TIMEOUT_S} s (hung)"
        if self.rc:
            return f"exit code {self.rc}: {error_line(self.tail)}"
        if len(self.losses) != self.iters:
            return f"{len(self.losses)} loss lines, expected {self.iters}"
        return None


def error_line(output: str) -> str:
    """The line saying why a launch failed: ours ("pretrain_gpt.py: error: ..."), else the last exception
    a worker printed (not torchrun's own ChildFailedError), else the last line."""
    lines = [line.strip() for line in output.strip().splitlines()]
    ours = [line for line in lines if "pretrain_gpt.py: error:" in line]
    raised = [line for line in lines if re.match(r"(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)\b", line)
              and "ChildFailedError" not in line]
    return (ours[:1] or raised[-1:] or lines[-1:] or [""])[0]


def result(status: str, reason: str, **details) -> dict:
    return {"status": status, "reason": reason, **details}



def launch(cmd: list[str], env: dict, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int | None, str, str]:
    """(exit code or None when killed at ``timeout``, stdout, stderr). The command runs in its own
    session, so a timeout kills torchrun's workers with it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def child_env(m: Machine, **extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", **extra}
    if m.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def train(m: Machine, flags: list[str], ranks: int, sync_debug: bool = False) -> Run:
    """A training launch through gpu_check_pretrain.py, run once per (flags, ranks, sync_debug)."""
    key = (tuple(flags), ranks, sync_debug)
    if key not in m.runs:
        m.runs[key] = _train(m, flags, ranks, sync_debug)
    return m.runs[key]


def _train(m: Machine, flags: list[str], ranks: int, sync_debug: bool) -> Run:
    reports = tempfile.mkdtemp(dir=m.workdir)
    port = free_port()
    runner = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(port)]
    cmd = [*runner, os.path.relpath(LAUNCHER, ROOT), *flags]
    env = child_env(m, MASTER_PORT=str(port), GPU_CHECK_REPORT=os.path.join(reports, "rank{rank}.json"),
                    GPU_CHECK_SYNC_DEBUG="1" if sync_debug else "0")
    rc, out, err = launch(cmd, env)
    per_rank = []
    for rank in range(ranks):
        path = os.path.join(reports, f"rank{rank}.json")
        if os.path.exists(path):  # a rank that died early wrote none
            with open(path) as f:
                per_rank.append({"rank": rank, **json.load(f)})
    return Run(" ".join(cmd), rc, int(flags[flags.index("--train-iters") + 1]),
               [float(x) for x in re.findall(r"lm loss: (\S+) \|", out)], per_rank, out[-2000:] + err[-4000:])


def compare(run: Run, reference: Run, bound: float) -> dict:
    """Every loss of ``run`` within ``bound`` (relative) of the reference's."""
    commands = {"command": run.command, "reference_command": reference.command}
    for label, r in (("run", run), ("reference", reference)):
        why = r.failure()
        if why:
            return result("fail", f"{label} failed: {why}", output_tail=r.tail, **commands)
    worst = max(abs(a - b) / abs(b) for a, b in zip(run.losses, reference.losses))
    details = dict(losses=run.losses, reference_losses=reference.losses, max_relative_difference=worst, bound=bound,
                   **commands)
    if worst <= bound:
        return result("pass", f"losses within {bound:.1e} relative (worst {worst:.1e})", **details)
    return result("fail", f"losses differ by {worst:.1e} relative, above {bound:.1e}", **details)


def chimera(d: int) -> list[str]:
    return ["--pipeline-model-parallel-size", str(d), "--pipeline-schedule", "chimera"]


# --- one GPU -----------------------------------------------------------------------------------------

def check_te_refuses_split_backward(m: Machine) -> dict:
    """--split-backward --transformer-impl transformer_engine: non-zero exit, exactly one error line
    naming --transformer-impl, no iteration run, nothing written under --save or --tensorboard-dir."""
    if m.need(1):
        return result("skipped", m.need(1))
    if not m.te:
        return result("skipped", "Transformer Engine not installed")
    out = tempfile.mkdtemp(dir=m.workdir)
    cmd = [sys.executable, "pretrain_gpt.py", *TINY, "--pipeline-schedule", "1f1b", "--split-backward",
           "--transformer-impl", "transformer_engine", "--save", os.path.join(out, "ckpt"), "--save-interval", "1",
           "--tensorboard-dir", os.path.join(out, "tb")]
    rc, stdout, stderr = launch(cmd, child_env(m, MASTER_PORT=str(free_port())))
    errors = [line for line in stderr.splitlines() if re.search(r"error:", line, re.IGNORECASE)]  # ours, raises
    problems = [p for p, bad in (
        (f"exit code {rc}", rc == 0 or rc is None),
        (f"{len(errors)} error lines, expected one naming --transformer-impl",
         len(errors) != 1 or "--transformer-impl" not in errors[0]),
        ("it trained", "lm loss:" in stdout),
        (f"it wrote {os.listdir(out)}", bool(os.listdir(out)))) if bad]
    details = dict(command=" ".join(cmd), exit_code=rc, error_lines=errors)
    if problems:
        return result("fail", "; ".join(problems), output_tail=(stdout + stderr)[-3000:], **details)
    return result("pass", f"refused: {errors[0]}", **details)


def check_split_backward_matches(m: Machine) -> dict:
    """Chimera D=2 with --split-backward against the same run unsplit (local layers, 2 ranks)."""
    base = TINY + LOCAL + chimera(2) + m.staging
    return compare(train(m, base + ["--split-backward"], 2), train(m, base, 2), FP32_RTOL)


def check_bf16_distributed_optimizer(m: Machine) -> dict:
    """megatron/chimera/testing/equivalence.py's bf16 Chimera D=2 case, distributed optimizer and host staging
    added, against its one-process bf16 reference with the distributed optimizer; its bound."""
    from megatron.chimera.testing.equivalence import MODEL, TOLERANCE, VARIANTS

    flags = MODEL + VARIANTS["bf16"] + ["--micro-batch-size", "1"] + COMMON + DISTOPT
    found = compare(train(m, flags + chimera(2) + m.staging, 2), train(m, flags, 1), TOLERANCE["bf16"][0])
    return {**found, "bound_source": "megatron/chimera/testing/equivalence.py TOLERANCE['bf16'][0] = ITERS x 2^-8"}


def check_no_sync_in_forward_backward(m: Machine) -> dict:
    """Sync-debug mode "error" around forward_backward: a one-process run, and every NCCL Chimera run
    this machine allows (the same launches as the nccl checks)."""
    if m.need(1):
        return result("skipped", m.need(1))
    runs = {"one process": train(m, TINY, 1, sync_debug=True)}
    for d in (2, 4):
        for name, (gpus, flags, _) in nccl_cases(d).items():
            if not m.need(gpus):
                runs[name] = train(m, flags, gpus, sync_debug=True)
    found = {name: run.failure() or "clean" for name, run in runs.items()}
    waits = {name: {f"rank {r['rank']}: {where}": n for r in run.reports for where, n in r["explicit_waits"].items()}
             for name, run in runs.items()}
    details = dict(runs=found, explicit_waits={name: w for name, w in waits.items() if w},
                   commands={name: run.command for name, run in runs.items()})
    bad = [(name, why) for name, why in found.items() if why != "clean"]
    if bad:
        return result("fail", f"{bad[0][0]}: {bad[0][1]}", **details)
    noted = sum(len(w) for w in waits.values())
    return result("pass", f"no host synchronisation inside forward_backward in {len(runs)} runs"
                  + (f"; {noted} explicit waits noted, not failed (explicit_waits)" if noted else ""), **details)


def check_memory_flat(m: Machine) -> dict:
    """max_memory_allocated at every hook of an ITERS-iteration Chimera D=2 run, from after iteration 2
    (its optimizer step included: "before iteration 3") to the end, grows by at most 1 MiB or 0.5%."""
    if m.need(1):
        return result("skipped", m.need(1))
    if m.gpus >= 2:
        gpus, flags, _ = nccl_cases(2)["nccl chimera D=2"]
        run = train(m, flags, gpus, sync_debug=True)
    else:
        run = train(m, TINY + LOCAL + chimera(2) + m.staging, 2)
    why = run.failure() or (None if len(run.reports) == 2 else f"{len(run.reports)} rank reports of 2")
    if why:
        return result("fail", f"run failed: {why}", command=run.command)
    series, over = {}, {}
    for report in run.reports:
        rank, points = report["rank"], report["memory"]
        start = [point[0] for point in points].index("before iteration 3")
        baseline = points[start][1]
        grew = max(peak for _, peak, _ in points[start:]) - baseline
        if grew > max(MIB, 0.005 * baseline):
            over[rank] = grew
        series[rank] = [[p, round(peak / MIB, 3), round(now / MIB, 3)] for p, peak, now in points]
    details = dict(series_mib=series, series_columns=["point", "max_memory_allocated", "memory_allocated"],
                   command=run.command)
    if over:
        return result("fail", f"peak grew after iteration 2 by more than max(1 MiB, 0.5%): {over} (rank: bytes)",
                      **details)
    return result("pass", "peak flat after iteration 2 on every rank", **details)


def check_layer_profile(m: Machine) -> dict:
    """One GPT-2 1.3B layer timed into profiles/gpu-<device>-<date>.json; the planner loads it and plans
    GPT-2 1.3B on 8 GPUs with it."""
    if m.need(1):
        return result("skipped", m.need(1))
    from chimera_schedules.tools.planner import ModelShape, Profile, plan

    timing = layer_times()
    interconnect = measure_interconnect(m) if m.gpus >= 2 else None
    path = write_profile(timing, interconnect)
    ranked = plan(8, 64, ModelShape(**GPT2_1_3B), Profile.load(path))
    return result("pass", f"wrote {os.path.relpath(path, ROOT)}; the planner's pick for 8 GPUs: {ranked[0].label}",
                  profile=os.path.relpath(path, ROOT), layer=timing,
                  interconnect=interconnect or "unmeasured (one GPU)")


def layer_times(repeats: int = 20) -> dict:
    """One GPT-2 1.3B layer in bf16 (Transformer Engine's where installed, as training would build it),
    built by the training program's own build_chunk in this process, on GPU 0."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron.chimera.config.arguments import parse_args
    from megatron.chimera.config.run_plan import make_run_plan
    from megatron.chimera.model.chunk import build_chunk, uses_transformer_engine

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    g = GPT2_1_3B
    args = parse_args(["--num-layers", "1", "--hidden-size", str(g["hidden"]), "--num-attention-heads", str(g["heads"]),
                       "--seq-length", str(g["seq"]), "--max-position-embeddings", str(g["seq"]), "--micro-batch-size",
                       "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "1000", "--bf16",
                       "--hidden-dropout", "0", "--attention-dropout", "0"], world_size=1)
    chunk = build_chunk(args, make_run_plan(args), 0, torch.device("cuda"))
    forward, backward = _time_layer(chunk.decoder.layers[0], repeats)
    dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name(), "forward_s": forward, "backward_s": backward, "dtype": "bf16",
            "transformer_engine": uses_transformer_engine(args, "cuda")}


def _time_layer(layer, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of one layer, timed with CUDA events after 5 warm-ups."""
    import torch

    x = torch.randn(GPT2_1_3B["seq"], 1, GPT2_1_3B["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fwd, bwd = [], []
    for i in range(repeats + 5):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = layer(x, attention_mask=None)[0]
        mid.record()
        out.backward(torch.ones_like(out))
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            fwd.append(start.elapsed_time(mid) / 1e3)
            bwd.append(mid.elapsed_time(end) / 1e3)
    return statistics.median(fwd), statistics.median(bwd)


def write_profile(timing: dict, interconnect: dict | None) -> str:
    """The planner's profile fields; unmeasured interconnect numbers are zero latency and infinite
    bandwidth (CostModel's own defaults), named under "unmeasured". Returns the path."""
    import torch

    from chimera_schedules.tools.planner import ModelShape

    name = timing["device"].replace(" ", "-").lower()
    network = interconnect or {"p2p_latency": 0.0, "p2p_bandwidth": math.inf, "allreduce_latency": 0.0,
                               "allreduce_bandwidth": math.inf}
    how = ("interconnect measured between 2 GPUs (NCCL p2p ping-pong of one activation, all-reduce)" if interconnect
           else "interconnect not measured (one GPU): zero latency and infinite bandwidth stand in")
    profile = {"name": f"gpu-{name} (measured {date.today()})",
               "source": f"Measured by scripts/gpu_check.py on {date.today()} ({timing['device']}, Transformer Engine: "
                         f"{timing['transformer_engine']}): one GPT-2 1.3B layer's bf16 forward, CUDA events; {how}.",
               "flops": ModelShape(**GPT2_1_3B).layer_forward_flops(1) / timing["forward_s"],
               **{k: network[k] for k in INTERCONNECT},
               "memory": torch.cuda.get_device_properties(0).total_memory}
    if not interconnect:
        profile["unmeasured"] = list(INTERCONNECT)
    path = os.path.join(ROOT, "profiles", f"gpu-{name}-{date.today()}.json")
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)  # math.inf as Infinity, which json.load (and Profile.load) read back
    return path


def measure_interconnect(m: Machine) -> dict:
    """This script's --interconnect-worker on 2 GPUs under torchrun; the planner's four numbers."""
    out = os.path.join(m.workdir, "interconnect.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.relpath(__file__, ROOT), "--interconnect-worker", out]
    rc, stdout, stderr = launch(cmd, child_env(m), timeout=180)
    if rc != 0:
        raise RuntimeError(f"interconnect measurement ({' '.join(cmd)}): exit code {rc}: {error_line(stdout + stderr)}")
    with open(out) as f:
        return json.load(f)


def interconnect_worker(out: str) -> None:
    """Ranks 0 and 1 on GPUs 0 and 1. p2p: one-way time t(n) = latency + n / bandwidth, fitted from 8
    bytes and one activation (the planner's activation_bytes: sequence x hidden x 2). All-reduce over
    r = 2: the planner's 2 log2(r) alpha + 2 (r-1)/r L / beta = 2 alpha + L / beta, from 8 bytes and 4
    layers' bf16 gradients."""
    import torch
    import torch.distributed as dist

    from chimera_schedules.tools.planner import ModelShape

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    shape = ModelShape(**GPT2_1_3B)
    activation, gradients = shape.seq * shape.hidden * 2, 4 * shape.params_per_layer * 2
    p2p = {n: _cuda_seconds(n, _ping_pong) / 2 for n in (8, activation)}  # a ping-pong is two transfers
    reduce = {n: _cuda_seconds(n, dist.all_reduce) for n in (8, gradients)}
    if dist.get_rank() == 0:
        numbers = {"p2p_latency": p2p[8], "p2p_bandwidth": (activation - 8) / (p2p[activation] - p2p[8]),
                   "allreduce_latency": reduce[8] / 2,
                   "allreduce_bandwidth": (gradients - 8) / (reduce[gradients] - reduce[8])}
        with open(out, "w") as f:
            json.dump({**numbers, "p2p_seconds": p2p, "allreduce_seconds": reduce}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _ping_pong(x) -> None:
    """Rank 0 sends to rank 1, which sends it back: two one-way transfers."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.send(x, 1)
        dist.recv(x, 1)
    else:
        dist.recv(x, 0)
        dist.send(x, 0)


def _cuda_seconds(nbytes: int, op, repeats: int = 50) -> float:
    """Seconds of one call of ``op`` on ``nbytes``: CUDA events around ``repeats`` calls after 5
    warm-ups (the first sets NCCL's communicator up)."""
    import torch

    x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(5):
        op(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        op(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


# --- two or more GPUs ---------------------------------------------------------------------------------

def nccl_cases(d: int) -> dict[str, tuple[int, list[str], list[str]]]:
    """name -> (GPUs, flags, the one-process reference's flags: the same layers)."""
    run = TINY + chimera(d)
    return {f"nccl chimera D={d}": (d, run, TINY),
            f"nccl chimera D={d} split-backward": (d, run + LOCAL + ["--split-backward"], TINY + LOCAL),
            f"nccl chimera D={d} distributed-optimizer": (d, run + DISTOPT, TINY),
            f"nccl chimera D={d} TP=2 sequence-parallel": (
                2 * d, run + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], TINY)}


def check_nccl(m: Machine, name: str, d: int) -> dict:
    """One NCCL case against one fp32 process, FP32_RTOL; run in sync-debug mode (check 4 reads it)."""
    gpus, flags, reference = nccl_cases(d)[name]
    if m.need(gpus):
        return result("skipped", m.need(gpus))
    return compare(train(m, flags, gpus, sync_debug=True), train(m, reference, 1), FP32_RTOL)


# --- the whole check ----------------------------------------------------------------------------------

def checks() -> list[tuple[str, object]]:
    found = [("te-refuses-split-backward", check_te_refuses_split_backward),
             ("split-backward-matches", check_split_backward_matches),
             ("bf16-distributed-optimizer", check_bf16_distributed_optimizer),
             ("no-sync-in-forward-backward", check_no_sync_in_forward_backward),
             ("memory-flat", check_memory_flat),
             ("layer-profile", check_layer_profile)]
    for d in (2, 4):
        found += [(name, functools.partial(check_nccl, name=name, d=d)) for name in nccl_cases(d)]
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
    return f"gpu_check: PASS ({passed} checks passed{why})"


def main() -> None:
    parser = argparse.ArgumentParser(description="The first-GPU check (see this file's docstring).")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="without a GPU: run the orchestration on the CPU (gloo); GPU-only checks skip")
    parser.add_argument("--out", help="the JSON to write (default benchmarks/results/gpu_check.json; with --cpu-smoke, "
                                      "gpu_check_cpu_smoke.json in the temporary directory)")
    parser.add_argument("--interconnect-worker", metavar="JSON", help=argparse.SUPPRESS)  # measure_interconnect's
    options = parser.parse_args()
    if options.interconnect_worker:
        interconnect_worker(options.interconnect_worker)
        return
    import torch

    if not options.cpu_smoke and not torch.cuda.is_available():
        sys.exit("gpu_check: FAIL: no GPU here (torch.cuda.is_available() is False); --cpu-smoke exercises the "
                 "script on the CPU")
    out = options.out or (os.path.join(tempfile.gettempdir(), "gpu_check_cpu_smoke.json") if options.cpu_smoke
                          else os.path.join(ROOT, "benchmarks", "results", "gpu_check.json"))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as workdir:
        gpus = 0 if options.cpu_smoke else torch.cuda.device_count()
        m = Machine(options.cpu_smoke, gpus, importlib.util.find_spec("transformer_engine") is not None, workdir)
        results = [run_check(name, check, m) for name, check in checks()]
    line = verdict(results)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"verdict": line, "date": str(date.today()), "mode": "cpu-smoke" if options.cpu_smoke else "gpu",
                   "device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus,
                   "transformer_engine": m.te, "torch": torch.__version__,
                   "seconds": round(time.monotonic() - start, 1), "checks": results}, f, indent=1)
    print(f"{line} [{os.path.relpath(out, ROOT) if out.startswith(ROOT) else out}]")
    sys.exit(1 if line.startswith("gpu_check: FAIL") else 0)


if __name__ == "__main__":
    main()
