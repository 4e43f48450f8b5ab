"""The emulated NCCL transport on real processes: the lowering completes under it; the executor's
former design (one group per pipeline, receives at need) hangs, and the timeout names the wait.
(The emulated equivalence cases, losses equal to one process, run in test_training.py.)"""
import json

import pytest

from megatron.chimera.testing.launch import launch


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
