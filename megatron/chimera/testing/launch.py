"""Launching the programs under test as a user does: ``python`` for one process, torchrun for more,
from the repository root, with one CPU thread per process (two cores are shared by every rank).

These helpers run the repository's own ``pretrain_gpt.py``, scripts and recipes, so they need the
source tree beside the package: the editable install ``scripts/setup_env.sh`` makes."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from megatron.chimera.distributed.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# Megatron-LM's log lines, as its log parsers read them
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def launch(nproc: int, *argv: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``argv`` (a script and its flags, or ``-m module ...``) in ``nproc`` processes; never raises on
    a non-zero exit, so a test can assert on how a program failed."""
    if nproc == 1:
        cmd = [sys.executable, *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), *argv]
    # a session of its own, so that a timeout ends torchrun's workers too, not only torchrun
    with subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run(nproc: int, *argv: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``launch``, asserting by default that the program succeeded (its output's tail on failure)."""
    proc = launch(nproc, *argv, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def losses(proc: subprocess.CompletedProcess) -> dict[int, str]:
    """Iteration -> 'lm loss' as printed, from a run's Megatron log lines."""
    return {int(i): v for i, v in LOSS.findall(proc.stdout)}


def train_args(corpus: list[str], *extra: str) -> list[str]:
    """pretrain_gpt.py and a tiny GPT on ``corpus`` (its data and tokenizer flags) for 4 iterations,
    evaluating every 2, with dropout off, reading in the training process (--num-workers 0: DataLoader workers
    fork every rank, twice, for a few tiny batches; the README's run and the conventions' keep Megatron-LM's 2);
    ``extra`` flags come last and win."""
    return ["pretrain_gpt.py", *corpus, "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-style", "cosine", "--min-lr", "3e-4",
            "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--train-iters", "4", "--num-workers", "0", *extra]
