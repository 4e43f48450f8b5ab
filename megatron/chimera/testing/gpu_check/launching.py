"""Training launches for gpu_check: each through scripts/gpu_check_pretrain.py (pretrain_gpt.py with the
check observer), run once per distinct (flags, ranks, environment) and shared by the checks that read
it; a comparison of losses against a reference launch; the result records the checks return; the
models the checks train. A launch of several ranks is torchrun's on this node, or, for the NCCL cases
of a multi-node check (--nodes), an srun step with one task per rank spread evenly over the nodes."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from megatron.chimera.distributed.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
LAUNCHER = os.path.join(ROOT, "scripts", "gpu_check_pretrain.py")
ITERS = 6
FP32_RTOL = 1e-5  # not the CPU suite's 1e-6: GPU kernels may reduce in another order
LAUNCH_TIMEOUT_S = 240  # past the 2-minute process-group timeout, so a hang ends in a failed collective first
MIB = 2 ** 20
COMMON = ["--log-interval", "1", "--distributed-timeout-minutes", "2"]
# A tiny GPT: vocab 128, 4 layers, hidden 64, sequence 64, mock data, no dropout, no biases.
TINY = ["--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--num-layers", "4",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear", "--eval-iters", "0", *COMMON]


def resized(hidden: int, heads: int, seq: int) -> list[str]:
    """TINY with another width and sequence length."""
    size = ["--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq)]
    return [*TINY[:TINY.index("--hidden-size")], *size, *TINY[TINY.index("--micro-batch-size"):]]


# TINY with 4 MiB fp32 activations between stages (sequence 2048 x hidden 512): far above the 1 MiB
# NCCL buffer the NCCL launches set (NCCL_BUFFSIZE), so a send completes only once its receive is posted
# and a rendezvous-order deadlock shows (NCCL_MODEL.md rule 2).
BIG = resized(512, 8, 2048)
LOCAL = ["--transformer-impl", "local"]
DISTOPT = ["--use-distributed-optimizer"]
# Megatron-LM's overlapped reductions and weight gathers, under our executor
OVERLAPPED = DISTOPT + ["--overlap-grad-reduce", "--overlap-param-gather"]
# Mixtral-style experts dispatched by all-to-all, balanced per sequence so that, at micro-batch size 2,
# --overlap-moe-expert-parallel-comm runs every action in two halves (config/schedule_request.py's halves_fit)
MOE = ["--normalization", "RMSNorm", "--swiglu", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "32", "--moe-router-load-balancing-type", "seq_aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"]
EP2 = ["--expert-model-parallel-size", "2"]
# plan mode: megatron-core's schedule plans run by our executor, each all-to-all on the communication stream
PLAN_MODE = EP2 + ["--overlap-moe-expert-parallel-comm"]
# The MoE model on a GPU, and the NCCL_BUFFSIZE of its NCCL runs: its pipeline messages (a micro-batch, 1 MiB)
# and all-to-alls (half a micro-batch's routed tokens to the other expert-parallel rank, 512 KiB if routing is
# even) are 4x the buffer and more, and far above NCCL's 16 KiB P2P_LL_THRESHOLD, under which point-to-point
# traffic takes the LL protocol, whose buffer NCCL_BUFFSIZE does not size (docs/notes/gpu-check.md)
MOE_BUFFSIZE = 128 * 1024
MOE_ON_GPU = resized(128, 4, 1024)


def moe_model(m: Machine) -> list[str]:
    """The MoE model every MoE check trains (one reference for all): TINY's experts on the CPU."""
    return with_flag(TINY if m.smoke else MOE_ON_GPU, "--micro-batch-size", "2") + MOE


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    i = flags.index(name)
    return [*flags[:i + 1], value, *flags[i + 2:]]


def chimera(d: int) -> list[str]:
    return ["--pipeline-model-parallel-size", str(d), "--pipeline-schedule", "chimera"]


@dataclass
class Machine:
    """What the checks run on, and the launches made so far (checks share identical launches). ``gpus``:
    this node's; ``apex``: why NVIDIA's apex with its kernels is unusable here, None where it is;
    ``nodes``: the nodes an NCCL case spreads over (an srun step per launch, inside a Slurm allocation);
    ``workdir`` is then on a file system every node shares."""
    smoke: bool
    gpus: int
    te: bool
    apex: str | None
    workdir: str
    nodes: int = 1
    runs: dict = field(default_factory=dict)

    @property
    def staging(self) -> list[str]:
        """Two ranks on one GPU talk over gloo through host memory (NCCL refuses two ranks on one device)."""
        return [] if self.smoke else ["--p2p-host-staging"]

    @property
    def all_gpus(self) -> int:
        return self.gpus * self.nodes

    def need(self, gpus: int, spread: bool = False) -> str | None:
        """Why a check needing ``gpus`` GPUs cannot run here, or None; ``spread``: a launch of one rank per
        GPU spread evenly over every node."""
        if self.gpus == 0:
            return "no GPU"
        if not spread or self.nodes == 1:
            return f"needs {gpus} GPUs" if self.gpus < gpus else None
        if gpus % self.nodes:
            return f"{gpus} ranks do not spread evenly over {self.nodes} nodes"
        return f"needs {gpus // self.nodes} GPUs per node" if self.gpus < gpus // self.nodes else None


@dataclass
class Run:
    command: str
    rc: int | None  # None: killed at LAUNCH_TIMEOUT_S
    iters: int
    losses: list[float]
    validation: list[float]
    reports: list[dict]
    tail: str
    times_ms: list[float] = field(default_factory=list)
    fusions_kept_off: list[str] = field(default_factory=list)  # the startup's "fusions kept off" lines

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
    """A check's record: status pass, fail, skipped, incomplete (could not check what it must) or measured (a
    figure reported, which nothing judges: it never counts as a pass)."""
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
    """The launch's environment: CUDA_DEVICE_MAX_CONNECTIONS=1 as Megatron-LM's scripts set it, unless
    ``extra`` maps it to None (removed); no GPU under --cpu-smoke."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", **extra}
    if m.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return {k: v for k, v in env.items() if v is not None}


def train(m: Machine, flags: list[str], ranks: int, sync: str = "off", actions: bool = False,
          env: dict | None = None, iters: int | None = None, spread: bool = False) -> Run:
    """A training launch through gpu_check_pretrain.py, run once per distinct request. ``sync``: the
    observer's sync-debug mode inside forward_backward ("off", "error", or "warn": each sync noted with
    its stack); ``actions``: per-action memory and the executor's clock; ``iters``: the iterations it
    runs, when not --train-iters (a launch that resumes or exits early); ``spread``: over every node
    (``Machine.nodes``), one rank per GPU."""
    env = env or {}
    spread = spread and m.nodes > 1 and ranks > 1
    key = (tuple(flags), ranks, sync, actions, tuple(sorted(env.items(), key=str)), spread)
    if key not in m.runs:
        m.runs[key] = _train(m, flags, ranks, sync, actions, env,
                             iters or int(flags[flags.index("--train-iters") + 1]), spread)
    return m.runs[key]


# One srun task per rank, as recipes/slurm/pretrain_gpt.sh starts them; each rank's NCCL log a file of its own
# (two nodes may give two processes one pid)
SRUN_TASK = ('if [ -n "${NCCL_DEBUG_FILE:-}" ]; then export NCCL_DEBUG_FILE=$NCCL_DEBUG_FILE.$SLURM_PROCID; fi; '
             'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec "$@"')


def runner(m: Machine, ranks: int, port: int, spread: bool) -> list[str]:
    """What starts the ranks: python itself for one, torchrun on this node, or an srun step spread evenly
    over the nodes (rank 0 on this one, the allocation's first: MASTER_ADDR)."""
    if ranks == 1:
        return [sys.executable]
    if spread:
        return ["srun", f"--nodes={m.nodes}", f"--ntasks={ranks}", f"--ntasks-per-node={ranks // m.nodes}",
                "--kill-on-bad-exit=1", "bash", "-c", SRUN_TASK, "bash", sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(port)]


def _train(m: Machine, flags: list[str], ranks: int, sync: str, actions: bool, env: dict, iters: int,
           spread: bool) -> Run:
    reports = tempfile.mkdtemp(dir=m.workdir)
    port = free_port()
    cmd = [*runner(m, ranks, port, spread), os.path.relpath(LAUNCHER, ROOT), *flags]
    where = {"MASTER_ADDR": os.environ.get("MASTER_ADDR") or socket.gethostname()} if spread else {}
    full_env = child_env(m, MASTER_PORT=str(port), GPU_CHECK_REPORT=os.path.join(reports, "rank{rank}.json"),
                         GPU_CHECK_SYNC=sync, GPU_CHECK_ACTIONS="1" if actions else "0", **where, **env)
    if "NCCL_DEBUG" in env:  # one NCCL log per process, which the rank's observer reads
        full_env["NCCL_DEBUG_FILE"] = os.path.join(reports, "nccl.%p.log")
    rc, out, err = launch(cmd, full_env)
    per_rank = []
    for rank in range(ranks):
        path = os.path.join(reports, f"rank{rank}.json")
        if os.path.exists(path):  # a rank that died early wrote none
            with open(path) as f:
                per_rank.append({"rank": rank, **json.load(f)})
    shown = " ".join(f"{k}={v if v is not None else '(unset)'}" for k, v in env.items())
    return Run((shown + " " if shown else "") + " ".join(cmd), rc, iters,
               [float(x) for x in re.findall(r"\| lm loss: (\S+) \|", out)],
               [float(x) for x in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+) \|", out)],
               per_rank, out[-2000:] + err[-4000:],
               [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): (\S+) \|", out)],
               re.findall(r"^ > fusions kept off: (.*)$", out, re.MULTILINE))


def compare(run: Run, reference: Run, bound: float) -> dict:
    """Every loss of ``run`` within ``bound`` (relative) of the reference's."""
    commands = {"command": run.command, "reference_command": reference.command}
    for label, r in (("run", run), ("reference", reference)):
        why = r.failure()
        if why:
            return result("fail", f"{label} failed: {why}", output_tail=r.tail, **commands)
    return compare_losses(run.losses, reference.losses, bound, **commands)


def compare_losses(losses: list[float], reference: list[float], bound: float, **details) -> dict:
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    details = dict(losses=losses, reference_losses=reference, max_relative_difference=worst, bound=bound, **details)
    if len(losses) != len(reference):
        return result("fail", f"{len(losses)} losses against the reference's {len(reference)}", **details)
    if worst <= bound:
        return result("pass", f"losses within {bound:.1e} relative (worst {worst:.1e})", **details)
    return result("fail", f"losses differ by {worst:.1e} relative, above {bound:.1e}", **details)
