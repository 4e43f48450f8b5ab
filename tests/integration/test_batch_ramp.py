"""Batch-size ramp-up as Megatron-LM's users run it (--step-batch-size-schedule): every global batch size
its own schedule, generated and proven at startup, each iteration sized by megatron-core's calculator from
the samples consumed. In fp32 a ramp trains as one process trains the same ramp, under Chimera and 1F1B, and
a checkpoint taken mid-ramp resumes at its batch size. The evaluation runs its own batch size
(--eval-global-batch-size), under its own schedule too. The one-process run is a launch of its own; the
2-process runs share one (the resumed run loads the Chimera run's checkpoint in the same processes)."""
import re

import pytest

from megatron.chimera.testing.cases import run_cases
from megatron.chimera.testing.launch import LOSS, VALID, run, train_args

CHIMERA2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]
# --seq-length 32: steps at samples 4 and 10, so the 5 iterations run batches of 2, 2, 4, 4 and 8
STEPS = ["--step-batch-size-schedule", "0:2 128:4 320:8"]
BATCHES = [2, 2, 4, 4, 8]
BATCH = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.* learning rate: (\S+) \| "
                   r"global batch size:\s+(\d+) \|")


def ramp_args(corpus, *extra: str) -> list[str]:
    """train_args without --global-batch-size (the ramp's last step is the global batch: Megatron-LM's rule)."""
    flags = train_args(corpus, *STEPS, "--train-iters", "5", "--eval-interval", "5", "--eval-global-batch-size", "4",
                       *extra)
    at = flags.index("--global-batch-size")
    return flags[:at] + flags[at + 2:]


@pytest.fixture(scope="module")
def ramps(corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("ramp")
    single = run(1, *ramp_args(corpus))
    return single, run_cases(2, {
        "chimera": ramp_args(corpus, *CHIMERA2, "--save", str(save), "--save-interval", "3"),
        "1f1b": ramp_args(corpus, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"),
        "chimera resumed": ramp_args(corpus, *CHIMERA2, "--load", str(save / "iter_0000003")),
    })


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def batches(proc) -> list[tuple[int, int, str, int]]:
    """(iteration, consumed samples, learning rate, global batch size) of each log line."""
    return [(int(i), int(c), lr, int(b)) for i, c, lr, b in BATCH.findall(proc.stdout)]


def close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: iterations {sorted(a)} against {sorted(b)}"
    for i in a:
        assert abs(float(a[i]) - float(b[i])) <= 1e-6 * abs(float(b[i])), f"{what} at iteration {i}: {a[i]} != {b[i]}"


@pytest.mark.parametrize("schedule", ["chimera", "1f1b"])
def test_a_ramp_trains_as_one_process_trains_it(ramps, schedule):
    single, runs = ramps
    proc, reference = ok(runs[schedule]), ok(single)
    assert [b for *_, b in batches(proc)] == BATCHES, batches(proc)
    assert batches(proc) == batches(reference), "consumed samples, learning rate or batch size differ"
    assert [int(c) for _, c, _, _ in batches(proc)] == [2, 4, 8, 12, 20], batches(proc)
    close(dict(LOSS.findall(proc.stdout)), dict(LOSS.findall(reference.stdout)), "lm loss")
    close(dict(VALID.findall(proc.stdout)), dict(VALID.findall(reference.stdout)), "validation loss")
    name = "chimera-direct" if schedule == "chimera" else "1f1b"
    assert (f" > batch-size ramp, 3 schedules: from sample 0: global batch size 2 ({name}, N=2); from sample 4: "
            f"global batch size 4 ({name}, N=4); from sample 10: global batch size 8 ({name}, N=8)") in proc.stdout


def test_a_checkpoint_taken_mid_ramp_resumes_at_its_batch_size(ramps):
    """Saved after iteration 3 (8 samples, batch 4); resumed, iteration 4 runs batch 4 and iteration 5 the next
    step's 8, with the uninterrupted run's losses."""
    _, runs = ramps
    uninterrupted, resumed = ok(runs["chimera"]), ok(runs["chimera resumed"])
    assert "loaded checkpoint from" in resumed.stdout and "at iteration 3" in resumed.stdout
    assert batches(resumed) == batches(uninterrupted)[3:], batches(resumed)
    assert LOSS.findall(resumed.stdout) == LOSS.findall(uninterrupted.stdout)[3:]
