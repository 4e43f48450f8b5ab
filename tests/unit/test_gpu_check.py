"""gpu_check's judgements, on made-up reports: the parts of it that decide pass or fail without a GPU."""
import importlib.util
import os

from megatron.chimera.testing.gpu_check.launching import MIB, Machine
from megatron.chimera.testing.gpu_check.multi_gpu import cases
from megatron.chimera.testing.gpu_check.single_gpu import _beyond_in_flight, _clock_problems, _memory_problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memory_held_until_the_flush_shows():
    """Two micro-batches of 10 MiB each: released at their backwards, the series stays within what is in
    flight; kept until the flush, it does not."""
    start = 100 * MIB
    released = [("F0p0s0", start + 10 * MIB), ("F1p0s0", start + 20 * MIB), ("B0p0s0", start + 10 * MIB),
                ("B1p0s0", start)]
    kept = [("F0p0s0", start + 10 * MIB), ("F1p0s0", start + 20 * MIB), ("B0p0s0", start + 20 * MIB),
            ("B1p0s0", start + 20 * MIB)]
    assert _beyond_in_flight(released, start)[0] <= 0
    beyond, where = _beyond_in_flight(kept, start)
    assert beyond > 15 * MIB and where == "B1p0s0"


def test_memory_growth_and_flush_are_named():
    rows = [[it, "F0p0s0", (100 + (5 if it == 4 else 0)) * MIB, 0] for it in range(1, 7)]
    marks = [[f"before iteration {it}", 0, 100 * MIB] for it in range(1, 7)] + \
        [[f"after backward {it}", 0, (103 if it == 5 else 100) * MIB] for it in range(1, 7)]
    found = _memory_problems({"actions": rows, "memory": marks}, cuda=True)["problems"]
    assert any("iteration 4's peak" in p for p in found), found
    assert any("after iteration 5's flush" in p for p in found), found


def test_clock_problems():
    assert _clock_problems([("F0", 0.0, 1.0), ("B0", 1.0, 2.0)], wall=2.5) == []
    found = _clock_problems([("F0", 0.0, 1.0), ("B0", 0.5, 0.4)], wall=1.0)
    assert any("ends before it starts" in p for p in found) and any("before F0 ends" in p for p in found)
    found = _clock_problems([("F0", 0.0, 3.0)], wall=1.0)
    assert any("more than the iteration" in p for p in found), found


def test_verdict_incomplete_without_transformer_engine():
    gpu_check = _script()
    results = [{"name": "a", "status": "pass", "reason": "ok"},
               {"name": "te", "status": "incomplete", "reason": "Transformer Engine not installed"}]
    assert gpu_check.verdict(results).startswith("gpu_check: INCOMPLETE")
    assert gpu_check.verdict(results + [{"name": "b", "status": "fail", "reason": "x"}]).startswith("gpu_check: FAIL")


def test_every_check_is_listed_under_cpu_smoke():
    """--cpu-smoke lists as many checks as a GPU machine (there, DP=2 renames some cases), each multi-GPU
    case with its CPU half or a reason."""
    gpu_check = _script()
    smoke, gpu = Machine(True, 0, False, "/tmp"), Machine(False, 8, True, "/tmp")
    assert len(gpu_check.checks(smoke)) == len(gpu_check.checks(gpu))
    # --emulate-nccl is added at launch, for the CPU half only
    assert all("--emulate-nccl" not in c.flags for c in cases(smoke)), [c.flags for c in cases(smoke)]
    assert all(c.not_on_cpu is None or c.not_on_cpu.startswith("cpu-smoke: ") for c in cases(smoke)), \
        [c.not_on_cpu for c in cases(smoke)]
    assert [c.name for c in cases(gpu) if c.name.startswith("nccl chimera D=2 DP=2")]  # DP > 1 with 8 GPUs
