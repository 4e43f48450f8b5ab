"""The pretraining program as a user runs it: the shipped corpus, tokenizer and preprocessing,
Chimera with evaluation, checkpoints that resume exactly, load into another layout, and survive a
crash mid-save. Each run is a new launch, as on a cluster."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_training import ENV, free_port  # noqa: E402

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def run(nproc: int, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                     "--nproc_per_node", str(nproc), "--master_port", free_port()]
    proc = subprocess.run(launcher + [*args], cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def train_args(corpus, *extra):
    return ["pretrain_gpt.py", *corpus, "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-style", "cosine", "--min-lr", "3e-4",
            "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--train-iters", "4", *extra]


CHIMERA2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]


def losses(proc) -> dict[int, str]:
    return {int(i): v for i, v in LOSS.findall(proc.stdout)}


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("ckpt") / "a"
    proc = run(2, *train_args(corpus, *CHIMERA2, "--save", str(save), "--save-interval", "2",
                              "--tensorboard-dir", str(save.parent / "tb")))
    return proc, save


def test_uninterrupted_run_logs_like_megatron(uninterrupted):
    proc, save = uninterrupted
    assert len(losses(proc)) == 4
    assert "elapsed time per iteration (ms):" in proc.stdout and "throughput (tokens/s):" in proc.stdout
    assert {int(i) for i, _ in VALID.findall(proc.stdout)} == {2, 4}
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(save / "iter_0000002")) == ["manifest.json", "metadata.pt", "mp_rank_00_000",
                                                         "mp_rank_00_001", "rng"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(save.parent / "tb"))


def test_resume_in_a_new_launch_repeats_the_uninterrupted_losses(uninterrupted, corpus, tmp_path):
    proc, save = uninterrupted
    resume = tmp_path / "resume"
    shutil.copytree(save / "iter_0000002", resume / "iter_0000002")
    (resume / "latest_checkpointed_iteration.txt").write_text("2")
    again = run(2, *train_args(corpus, *CHIMERA2, "--load", str(resume)))
    assert "loaded checkpoint" in again.stdout
    assert losses(again) == {3: losses(proc)[3], 4: losses(proc)[4]}
    assert VALID.findall(again.stdout)[-1] == VALID.findall(proc.stdout)[-1]


def test_chimera_checkpoint_loads_into_one_process(uninterrupted, corpus):
    proc, save = uninterrupted
    single = run(1, *train_args(corpus, "--load", str(save)))
    chimera_valid = float(VALID.findall(proc.stdout)[-1][1])
    single_valid = float(VALID.findall(single.stdout)[-1][1])
    assert abs(single_valid - chimera_valid) <= 1e-6 * chimera_valid


def test_crash_during_a_checkpoint_write_keeps_the_previous_one(corpus, tmp_path):
    save = tmp_path / "crash"
    proc = run(2, *train_args(corpus, *CHIMERA2, "--save", str(save), "--save-interval", "2"),
               env={"CHIMERA_TEST_KILL_DURING_SAVE": "4"}, check=False)
    assert proc.returncode != 0
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (save / "iter_0000004.tmp").is_dir() and not (save / "iter_0000004").exists()
    resumed = run(1, *train_args(corpus, "--load", str(save), "--train-iters", "3",
                                   "--use-checkpoint-opt_param-scheduler"))
    assert "loaded checkpoint from" in resumed.stdout and "at iteration 2" in resumed.stdout
    assert list(losses(resumed)) == [3]
