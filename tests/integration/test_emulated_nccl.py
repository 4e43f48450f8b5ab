"""The emulated NCCL transport on real processes: the lowering completes under it; the executor's
former design (one group per pipeline, receives at need) hangs, and the timeout names the wait; MoE
runs touch no group the warm-up before iteration 1 did not walk (its guard is on under --emulate-nccl).
(The emulated equivalence cases, losses equal to one process, run in test_training.py.)"""
import json
import re

import pytest

from megatron.chimera.testing.cases import run_cases
from megatron.chimera.testing.launch import launch, losses


def probe(design: str) -> dict:
    proc = launch(2, "-m", "megatron.chimera.testing.emulated_nccl_probe", "--design", design, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


def test_lowered_communication_completes_under_emulated_nccl():
    assert probe("lowered") == {"design": "lowered", "completed": True, "error": None}


@pytest.mark.filterwarnings("ignore")
def test_former_one_group_per_pipeline_design_hangs_and_the_timeout_names_it():
    result = probe("legacy")
    assert not result["completed"]
    assert "timed out after 6s" in result["error"] and "on group p0" in result["error"]


# Chimera D=2 on 4 ranks, a tiny MoE (the layers after the first), trained one iteration then evaluated
MOE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--max-position-embeddings", "16", "--vocab-size", "128", "--mock-data", "--lr", "1e-3",
       "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1", "--eval-iters", "1",
       "--log-interval", "1", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff",
       "1e-2", "--moe-layer-freq", "[0]+[1]*3", "--disable-bias-linear", "--emulate-nccl",
       "--distributed-timeout-minutes", "0.5"]
WARMED = re.compile(r" > communicators created before iteration 1: up to (\d+) collective groups \((\d+) without "
                    r"sharing\) and (\d+) p2p pairs per rank")


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """The MoE layouts whose groups megatron-core reaches first inside iteration 1, in one launch (the
    first case builds the mock data's indices, the others load them)."""
    flags = MOE + ["--data-cache-path", str(tmp_path_factory.mktemp("data_cache"))]
    return run_cases(4, {
        "EP=2 alltoall": flags + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
        "TP=2 EP=2 allgather": flags + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
                                      "--moe-token-dispatcher-type", "allgather"],
        "ETP=2 alltoall": flags + ["--expert-tensor-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    }, timeout=300)


@pytest.mark.parametrize("case, counts", [
    # rank 0: the world, TP [0], TP-CP [0], DP, EP and expert-TP x EP [0, 1] (megatron-core's), the stages'
    # replica groups with the embedding group [0-3], PP [0, 2] with the stages' expert replica groups
    ("EP=2 alltoall", (8, 12, 2)),
    # TP and TP-CP [0, 1], DP [0], expert-TP x EP [0, 1]; PP [0, 2] with all five of ours
    ("TP=2 EP=2 allgather", (6, 11, 2)),
    ("ETP=2 alltoall", (8, 12, 2)),  # expert-TP in EP's place
])
def test_moe_touches_only_groups_warmed_up_before_iteration_1(moe_runs, case, counts):
    """Under --emulate-nccl every collective and p2p goes through the guard: a group first used inside
    iteration 1 or evaluation (the cross entropy's TP group at TP=1, the dispatchers' expert groups,
    the router's and the metrics tracker's groups) would end the run with the line naming it."""
    proc = moe_runs[case]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len(losses(proc)) == 1 and "validation loss at iteration 1" in proc.stdout
    assert tuple(map(int, WARMED.search(proc.stdout).groups())) == counts
