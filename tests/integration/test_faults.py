"""Fail loudly, never hang, lose nothing: every configuration rule fails before anything starts; a dead
peer, SIGTERM, NaNs and corrupted checkpoints end every rank cleanly with a clear message."""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron.chimera.arguments import parse_args
from megatron.chimera.checkpoint.checkpointing import SHAPE_KEYS
from megatron.chimera.distributed.ports import free_port
from megatron.chimera.testing.launch import ROOT, launch

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128", "--num-workers", "0"]


def fake_checkpoint(root, hidden: int):
    """A torch_dist checkpoint directory whose common state describes a model of another hidden size."""
    folder = root / "iter_0000001"
    folder.mkdir(parents=True)
    ours = parse_args(MODEL, world_size=1)
    shape = {k: getattr(ours, k) for k in SHAPE_KEYS} | {"hidden_size": hidden}
    torch.save({"iteration": 1, "args": argparse.Namespace(**shape)}, folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    (root / "latest_checkpointed_iteration.txt").write_text("1")


RULES = [  # (flags, world size, what the one line must say)
    (["--pipeline-model-parallel-size", "3", "--num-layers", "6", "--pipeline-schedule", "chimera"], 3,
     "--pipeline-model-parallel-size=3: Chimera needs an even number of stages"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera", "--chimera-pipelines", "3"], 4,
     "--chimera-pipelines=3: Chimera needs an even number of pipelines"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera", "--chimera-pipelines", "6",
      "--num-layers", "8", "--global-batch-size", "12"], 4, "--chimera-pipelines=6: P/2 must divide D/2 = 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "7"], 2, "--num-layers=7: must be divisible by the 2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved", "--num-layers", "8",
      "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     "--num-layers-per-virtual-pipeline-stage=3: PP x it must divide"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1,
     "--global-batch-size=6: must be a multiple of micro-batch size"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera", "--global-batch-size", "6"], 4,
     "--global-batch-size=6: gives 6 micro-batches per pipeline replica"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--chimera-concat", "doubling",
      "--global-batch-size", "6"], 2, "forward doubling pairs basic units"),
    (["--pipeline-model-parallel-size", "2"], 3,
     "--pipeline-model-parallel-size=2: TP x PP = 2 must divide the world size 3"),
    (["--seq-length", "32"], 1, "--seq-length=32: must not exceed --max-position-embeddings (16)"),
    (["--data-path", "/nonexistent/corpus"], 1, "--data-path="),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/nonexistent/tok.model"], 1,
     "--tokenizer-model=/nonexistent/tok.model: must name an existing SentencePiece model file"),
    (["--load", "{tmp}/empty"], 1, "no checkpoint there (no latest_checkpointed_iteration.txt)"),
    (["--load", "{tmp}/other_shape"], 1, "checkpoint has --hidden-size=64, this run 32: model shapes must match"),
    (["--save", "{tmp}/a_file/below"], 1, "--save={tmp}/a_file/below: must be a writable directory"),
    (["--hidden-size", "0"], 1, "--hidden-size=0: must be positive"),
    (["--micro-batch-size", "-1"], 1, "--micro-batch-size=-1: must be positive"),
    (["--lr", "-0.1"], 1, "--lr=-0.1: must not be negative"),
    (["--save-interval", "0"], 1, "--save-interval=0: must be positive"),
    (["--pipeline-schedule", "zigzag"], 1, "argument --pipeline-schedule: invalid choice: 'zigzag'"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", "--chimera-concat", "halving"], 2,
     "--chimera-concat=halving: applies to --pipeline-schedule chimera only"),
]


@pytest.mark.parametrize("flags,world,needle", RULES, ids=[r[2][:40] for r in RULES])
def test_every_rule_fails_before_anything_starts(tmp_path, capsys, flags, world, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    fake_checkpoint(tmp_path / "other_shape", hidden=64)
    before = sorted(p for p in tmp_path.rglob("*"))
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    argv = [a for a in MODEL if not (flags[:1] == ["--data-path"] and a == "--mock-data")]
    argv += ["--save-interval", "1000"] + flags  # Megatron-LM requires it with --save
    argv += [] if "--save" in flags else ["--save", str(tmp_path / "new_save")]
    argv += ["--tensorboard-dir", str(tmp_path / "new_tb")]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=world)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and needle.replace("{tmp}", str(tmp_path)) in err, err
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_refusal_under_torchrun_is_printed_once_though_another_rank_refuses_first(tmp_path):
    """Under torchrun the agent ends every rank once one exits with an error. Rank 0, which prints the
    refusal, starts 3 s late here, so rank 1 always refuses first (the race, forced on every run): rank 1
    waits for rank 0's line before it exits, and the line is printed once."""
    bad = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--seq-length", "32"]
    proc = launch(2, "-m", "megatron.chimera.testing.pretrain_with_faults", *MODEL, *bad, "--save",
                  str(tmp_path / "ckpt"), "--save-interval", "1000", env={"CHIMERA_TEST_RANK0_LATE": "3"})
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert proc.returncode != 0 and len(said) == 1 and "--seq-length=32" in said[0], \
        f"exit code {proc.returncode}, error lines {said}: {proc.stderr[-2000:]}"
    assert not (tmp_path / "ckpt").exists(), "a refused run wrote its checkpoint folder"


# ---------------------------------------------------------------------------------- runtime faults

def ranks(*argv, env=None, per_rank=((), ())):
    """Two ranks as plain processes (no torchrun, whose agent would kill the survivor for us); with ``env``,
    pretrain_gpt.py with the faults it names injected (megatron/chimera/testing/fault_hooks.py).
    ``per_rank``: flags one rank adds."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        e = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(env or {})}
        program = ["-m", "megatron.chimera.testing.pretrain_with_faults"] if env else ["pretrain_gpt.py"]
        procs.append(subprocess.Popen([sys.executable, *program, *argv, *per_rank[rank]], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


CHIMERA2 = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "128", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
            "chimera", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--lr-decay-style", "constant", "--num-workers", "0",
            "--distributed-timeout-minutes", "2"]  # its value last: a test replaces it


def test_ranks_that_built_different_schedules_fail_in_one_line_before_training():
    p0, p1 = ranks(*CHIMERA2, "--train-iters", "2", per_rank=((), ("--chimera-concat", "doubling")))
    (out0, err0), (out1, err1) = p0.communicate(timeout=120), p1.communicate(timeout=120)
    assert (p0.returncode, p1.returncode) == (1, 1)
    lines = [line for line in (err0 + err1).splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(lines) == 1 and re.fullmatch(r"pretrain_gpt.py: error: --pipeline-schedule=chimera: the ranks built "
                                            r"different schedules \(ranks 0 built \w+; ranks 1 built \w+\): .*",
                                            lines[0])
    assert not re.search(r"iteration\s+\d+/", out0 + out1)  # nothing trained


def test_a_killed_rank_ends_the_other_with_a_clear_message():
    p0, p1 = ranks(*CHIMERA2, "--train-iters", "50", env={"CHIMERA_TEST_FAULT": "kill 1@3"})
    out0, err0 = p0.communicate(timeout=300)
    p1.communicate(timeout=30)
    assert p1.returncode == -signal.SIGKILL and p0.returncode != 0
    line = next(x for x in err0.splitlines() if x.startswith("pretrain_gpt.py: error:"))
    assert "rank 0" in line and "iteration 3" in line, line
    assert "Timed out" not in line, line  # the closed connection ended it, not the 2-minute timeout
    assert re.search(r"waited for the (activation|gradient) of micro-batch \d+, pipeline \d, stage \d from worker 1",
                     line) or "a collective failed" in line, line


@pytest.mark.slow
def test_a_silent_rank_ends_the_other_after_the_distributed_timeout():
    p0, p1 = ranks(*CHIMERA2[:-1], "0.25", "--train-iters", "50", env={"CHIMERA_TEST_FAULT": "hang 1@3"})  # 15 s
    try:
        start = time.time()
        _, err0 = p0.communicate(timeout=300)  # far below Megatron-LM's default of 10 minutes
        assert p0.returncode != 0 and time.time() - start >= 15, (p0.returncode, time.time() - start)
        assert p1.poll() is None  # the hung rank is still there: only the launcher can reap it
    finally:
        p1.kill()
        p1.communicate()
    line = next(x for x in err0.splitlines() if x.startswith("pretrain_gpt.py: error:"))
    assert "rank 0" in line and "iteration 3" in line and "Timed out waiting 15000ms" in line, line  # the flag's 0.25
    assert re.search(r"waited for the (activation|gradient) of micro-batch \d+, pipeline \d, stage \d from worker 1",
                     line)


def error_line(err: str) -> str:
    """The one line a rank ends with; the end of its stderr when there is none."""
    lines = [x for x in err.splitlines() if x.startswith("pretrain_gpt.py: error:")]
    assert lines, err[-3000:]
    return lines[0]


def test_a_forward_that_raises_is_named_on_its_rank_and_ends_the_peer():
    """Rank 1's first forward of iteration 2 raises (fault_hooks.py) under Chimera, whose executor names
    the action, and megatron-core's 1F1B, which cannot: rank 1 prints the traceback, then one line with
    the original first line, not called a collective failure; rank 0 ends with a failed wait."""
    runs = {schedule: ranks(*CHIMERA2, "--pipeline-schedule", schedule, "--train-iters", "3",
                            env={"CHIMERA_TEST_FAULT": "raise 1@2"}) for schedule in ("chimera", "megatron-1f1b")}
    errs = {schedule: [p.communicate(timeout=120)[1] for p in procs] for schedule, procs in runs.items()}
    assert [p.returncode for procs in runs.values() for p in procs] == [1] * 4
    line = {(schedule, rank): error_line(err) for schedule, both in errs.items() for rank, err in enumerate(both)}
    raised = "raised RuntimeError: chimera test fault: this forward raised (iteration 2)"
    assert re.fullmatch(r"pretrain_gpt.py: error: rank 1 \(worker 1\): the forward of micro-batch (\d+), pipeline "
                        r"(\d), stage (\d) \(F\1p\2s\3\) " + re.escape(raised), line["chimera", 1])
    assert line["megatron-1f1b", 1] == ("pretrain_gpt.py: error: rank 1: a forward or backward of megatron-core's "
                                        "megatron-1f1b schedule failed: RuntimeError: chimera test fault: this forward "
                                        "raised (iteration 2)")
    for schedule in runs:
        assert "in _raise_in_forward" in errs[schedule][1].split("pretrain_gpt.py: error:")[0]  # the traceback
        assert "(iteration 2)" in line[schedule, 0] and line[schedule, 0].startswith("pretrain_gpt.py: error: rank 0")
    assert re.search(r"waited for the (activation|gradient) of micro-batch \d+, pipeline \d, stage \d from worker 1",
                     line["chimera", 0]) or "a collective failed" in line["chimera", 0], line["chimera", 0]
    assert "rank 0: a collective failed: " in line["megatron-1f1b", 0]


LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|")


@pytest.mark.slow
def test_sigterm_saves_and_the_resumed_run_continues_exactly(tmp_path):
    save = tmp_path / "ckpt"
    p0, p1 = ranks(*CHIMERA2, "--train-iters", "20", "--exit-signal-handler", "--save", str(save),
                   "--save-interval", "1000")
    for line in p1.stdout:  # the last rank logs
        if re.search(r"iteration\s+3/", line):
            break
    p0.send_signal(signal.SIGTERM)  # one rank gets it; the ranks agree at the next boundary
    out0, err0 = p0.communicate(timeout=120)
    out1, err1 = p1.communicate(timeout=120)
    assert p0.returncode == 0 and p1.returncode == 0, err0[-2000:] + err1[-2000:]
    stopped = int(re.search(r"exiting on SIGTERM at iteration (\d+) after saving it", out1).group(1))
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(stopped) and stopped < 20
    resumed = ranks(*CHIMERA2, "--train-iters", "20", "--load", str(save))
    uninterrupted = ranks(*CHIMERA2, "--train-iters", "20")
    outs = [p.communicate(timeout=300) for p in resumed + uninterrupted]
    assert [p.returncode for p in resumed + uninterrupted] == [0] * 4, "".join(err[-2000:] for _, err in outs)
    got, want = dict(LOSS.findall(outs[1][0])), dict(LOSS.findall(outs[3][0]))
    assert min(int(k) for k in got) == stopped + 1 and got == {k: v for k, v in want.items() if int(k) > stopped}


def test_nan_iterations_are_skipped_counted_and_stop_the_run(tmp_path):
    save = tmp_path / "ckpt"
    p0, p1 = ranks(*CHIMERA2, "--train-iters", "10", "--save", str(save), "--save-interval", "1",
                   "--max-consecutive-nan-iterations", "3", env={"CHIMERA_TEST_NAN_ITERATIONS": "2,4,5,6"})
    out1, err1 = p1.communicate(timeout=120)
    out0, err0 = p0.communicate(timeout=60)
    assert p0.returncode != 0 and p1.returncode != 0
    counts = {int(i): int(n) for i, n in re.findall(r"iteration\s+(\d+)/.*number of nan iterations:\s+(\d+)", out1)}
    assert counts == {1: 0, 2: 1, 3: 0, 4: 1, 5: 1, 6: 1}  # per log line, as Megatron-LM counts them
    assert "3 iterations in a row (4-6) had a NaN or Inf loss or gradient norm" in err1
    assert "the last good checkpoint is iteration 3" in err1
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_corrupted_and_truncated_checkpoint_files_are_named(tmp_path):
    save = tmp_path / "ckpt"
    for p in ranks(*CHIMERA2, "--train-iters", "2", "--save", str(save), "--save-interval", "2"):
        assert p.wait(timeout=120) == 0
    shard = save / "iter_0000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))
    procs = ranks(*CHIMERA2, "--train-iters", "3", "--use-checkpoint-opt_param-scheduler", "--load", str(save))
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode != 0 for p in procs), f"exit codes: {[p.returncode for p in procs]}"
    assert any("__1_0.distcp" in e and "is corrupted (its sha256 does not match manifest.json)" in e
               for e in errs), errs
    shard.write_bytes(bytes(data[: len(data) // 3]))  # truncated: caught before any process group exists
    procs = ranks(*CHIMERA2, "--train-iters", "3", "--use-checkpoint-opt_param-scheduler", "--load", str(save))
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 2 for p in procs), f"exit codes, 2 expected: {[p.returncode for p in procs]}"
    assert ["is truncated or missing" in e for e in errs] == [True, False], errs  # printed once, by rank 0
