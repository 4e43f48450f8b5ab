"""Megatron-LM's rerun state machine (megatron-core's RerunStateMachine) around Chimera's iterations.

Without a fault, a re-run replays the iteration exactly: --rerun-mode report_stats re-runs every iteration
(with dropout on, so the generators must be restored) and trains as a run with the machine disabled. With
injected errors, megatron-core's verdicts, logged in its own lines, as Megatron-LM's functional tests
(gpt3_mcore_reruns_transient, gpt3_mcore_reruns_persistent_1) look for them: a transient error ends the run
with exit code 17; a persistent one saves a checkpoint of the iterations done and exits with 16."""
import pytest

from megatron.chimera.testing.cases import run_cases
from megatron.chimera.testing.launch import LOSS, launch

CHIMERA2 = ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--log-interval", "1",
            "--num-workers", "0", "--eval-iters", "0", "--train-iters", "3"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.fixture(scope="module")
def replays():
    return run_cases(2, {
        "disabled": CHIMERA2 + DROPOUT + ["--rerun-mode", "disabled"],
        "report_stats": CHIMERA2 + DROPOUT + ["--rerun-mode", "report_stats"],
        "validated": CHIMERA2 + DROPOUT + ["--check-for-spiky-loss", "--check-for-large-grads"],
    })


@pytest.mark.parametrize("mode", ["report_stats", "validated"])
def test_a_rerun_replays_the_iteration_exactly(replays, mode):
    for name in ("disabled", mode):
        assert replays[name].returncode == 0, replays[name].stdout[-3000:] + replays[name].stderr[-3000:]
    assert LOSS.findall(replays[mode].stdout) == LOSS.findall(replays["disabled"].stdout)
    assert len(LOSS.findall(replays[mode].stdout)) == 3


def injected(kind: str, *flags: str):
    return launch(2, *CHIMERA2, "--hidden-dropout", "0", "--attention-dropout", "0", "--error-injection-rate", "1",
                  "--error-injection-type", kind, *flags)


def test_an_injected_transient_error_ends_the_run_with_megatron_cores_verdict():
    proc = injected("transient_error")
    assert "(exitcode: 17)" in proc.stderr, proc.stderr[-3000:]
    for line in ("WARNING:megatron.core.rerun_state_machine:Result validation enabled",
                 "WARNING:megatron.core.rerun_state_machine:Injecting error type Transient error",
                 "iteration #2: Possible transient error!!"):
        assert line in proc.stderr, f"no {line!r} in {proc.stderr[-3000:]}"
    assert [int(i) for i, _ in LOSS.findall(proc.stdout)] == [1], "an iteration after the verdict was logged"


def test_an_injected_persistent_error_saves_the_iterations_done_and_exits_to_be_resumed(tmp_path):
    proc = injected("persistent_error", "--save", str(tmp_path), "--save-interval", "10")
    assert "(exitcode: 16)" in proc.stderr, proc.stderr[-3000:]
    for line in ("Injecting error type Persistent error",
                 "First rerun: unexpected result is reproducible within the tolerance",
                 "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
                 "iteration and establish a diagnostic"):
        assert line in proc.stderr, f"no {line!r} in {proc.stderr[-3000:]}"
    assert "saved checkpoint at iteration 1" in proc.stdout
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
