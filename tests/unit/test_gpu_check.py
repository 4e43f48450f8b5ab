"""gpu_check's judgements, on made-up reports: the parts of it that decide pass or fail without a GPU."""
import importlib.util
import os
import subprocess

from megatron.chimera.testing.gpu_check import multi_gpu, single_gpu
from megatron.chimera.testing.gpu_check.launching import MIB, Machine, Run, runner
from megatron.chimera.testing.gpu_check.multi_gpu import NCCL_ENV, cases, check_case
from megatron.chimera.testing.gpu_check.single_gpu import (
    _beyond_in_flight,
    _clock_problems,
    _memory_problems,
    check_apex_kernels,
)

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
    case with its CPU half or a reason; it runs a data-parallel case (DP=2 at D=2, four gloo ranks)."""
    gpu_check = _script()
    smoke, gpu = Machine(True, 0, False, None, "/tmp"), Machine(False, 8, True, None, "/tmp")
    assert len(gpu_check.checks(smoke)) == len(gpu_check.checks(gpu))
    # --emulate-nccl is added at launch, for the CPU half only
    assert all("--emulate-nccl" not in c.flags for c in cases(smoke)), [c.flags for c in cases(smoke)]
    assert all(c.not_on_cpu is None or c.not_on_cpu.startswith("cpu-smoke: ") for c in cases(smoke)), \
        [c.not_on_cpu for c in cases(smoke)]
    assert [c.name for c in cases(gpu) if c.name.startswith("nccl chimera D=2 DP=2")]  # DP > 1 with 8 GPUs
    data_parallel = [c.name for c in cases(smoke) if "D=2 DP=2" in c.name and c.not_on_cpu is None and c.ranks == 4]
    assert data_parallel, f"--cpu-smoke runs no DP=2 case: {[c.name for c in cases(smoke)]}"


def test_apex_unusable_is_incomplete_not_pass():
    """Without apex's kernels the apex check, and the TE case that needs its gradient-accumulation fusion,
    say INCOMPLETE; neither launches anything to say so (no TE either here)."""
    gpu_check = _script()
    m = Machine(False, 2, False, "fused_weight_gradient_mlp_cuda does not import", "/tmp")
    found = check_apex_kernels(m)
    assert found["status"] == "incomplete" and "fused_weight_gradient_mlp_cuda" in found["reason"], found
    fused = [c for c in cases(m) if "apex" in c.needs]
    assert fused and all(check_case(m, c)["status"] == "incomplete" for c in fused), [c.name for c in fused]
    assert m.runs == {}, f"launched {list(m.runs)}"
    line = gpu_check.verdict([{"name": "a", "status": "pass", "reason": "ok"}, {"name": "apex-kernels", **found}])
    assert line.startswith("gpu_check: INCOMPLETE") and "apex-kernels" in line, line
    assert check_apex_kernels(Machine(True, 0, False, None, "/tmp"))["status"] == "skipped"


def test_moe_messages_exceed_the_nccl_buffer():
    """On NCCL, every MoE case's pipeline message (a micro-batch's activations) and all-to-all message (a
    half micro-batch's routed tokens to the other expert-parallel rank, routing even) exceeds the
    NCCL_BUFFSIZE it runs with, and NCCL's 16 KiB P2P_LL_THRESHOLD, above which p2p uses that buffer."""
    moe = [c for c in cases(Machine(False, 8, True, None, "/tmp")) if "--num-experts" in c.flags]
    assert len(moe) >= 2, [c.name for c in moe]
    for case in moe:
        value = {name: int(case.flags[case.flags.index(name) + 1]) for name in (
            "--micro-batch-size", "--seq-length", "--hidden-size", "--moe-router-topk", "--expert-model-parallel-size")}
        tokens = value["--micro-batch-size"] * value["--seq-length"]
        pipeline = tokens * value["--hidden-size"] * 4
        all_to_all = tokens // 2 * value["--moe-router-topk"] * value["--hidden-size"] * 4 // value[
            "--expert-model-parallel-size"]
        buffer = int({**NCCL_ENV, **case.env}["NCCL_BUFFSIZE"])
        assert min(pipeline, all_to_all) >= 4 * buffer > 4 * 16384, (case.name, pipeline, all_to_all, buffer)


def test_nccl_cases_spread_over_the_nodes():
    """With --nodes 2 a case's ranks are an srun step, half on each node; references and host-staged runs
    stay torchrun's or one process on the first node."""
    m = Machine(False, 4, True, None, "/tmp", nodes=2)
    assert m.need(8, spread=True) is None and m.need(8) == "needs 8 GPUs"
    assert m.need(16, spread=True) == "needs 8 GPUs per node"
    srun = runner(m, 4, 1234, spread=True)
    assert srun[:5] == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--kill-on-bad-exit=1"], srun
    assert runner(m, 4, 1234, spread=False)[1:3] == ["-m", "torch.distributed.run"]
    shown = "echo $RANK $LOCAL_RANK $WORLD_SIZE $NCCL_DEBUG_FILE"
    task = subprocess.run(["bash", "-c", srun[7], "bash", "sh", "-c", shown],
                          env={"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
                               "NCCL_DEBUG_FILE": "/r/nccl.%p.log", "PATH": os.environ["PATH"]},
                          capture_output=True, text=True, check=True)
    assert task.stdout.split() == ["3", "1", "4", "/r/nccl.%p.log.3"], task.stdout
    sbatch = open(os.path.join(ROOT, "recipes", "slurm", "gpu_check_two_nodes.sbatch")).read()
    assert "#SBATCH --nodes=2" in sbatch and 'scripts/gpu_check.py --nodes "$SLURM_JOB_NUM_NODES"' in sbatch


def test_across_nodes_reads_where_each_rank_ran(monkeypatch):
    """--nodes 2: a run whose ranks all ran on one host fails nccl-across-nodes; one node skips it with the
    batch script to run."""
    def run(*hosts):
        return Run("cmd", 0, 1, [1.0], [], [{"rank": i, "host": h} for i, h in enumerate(hosts)], "")
    m = Machine(False, 8, True, None, "/tmp", nodes=2)
    monkeypatch.setattr(multi_gpu, "nccl_runs", lambda m: {"spread": run("a", "a", "b", "b"), "one": run("a", "a")})
    found = multi_gpu.check_across_nodes(m)
    assert found["status"] == "fail" and found["reason"].startswith("one: its ranks ran on 1 hosts"), found
    monkeypatch.setattr(multi_gpu, "nccl_runs", lambda m: {"spread": run("a", "b")})
    assert multi_gpu.check_across_nodes(m)["status"] == "pass"
    skipped = multi_gpu.check_across_nodes(Machine(False, 8, True, None, "/tmp"))
    assert skipped["status"] == "skipped" and "gpu_check_two_nodes.sbatch" in skipped["reason"], skipped


def test_a_timing_is_a_measurement_never_a_pass(monkeypatch):
    """timed-against-megatron-1f1b reports its ratio as measured, at any speed, and the verdict counts it
    apart from the checks that passed."""
    gpu_check = _script()
    times = {"chimera": [9.0, 9.0, 5.0, 5.0], "megatron-1f1b": [9.0, 9.0, 50.0, 50.0]}
    monkeypatch.setattr(multi_gpu, "train", lambda m, flags, ranks: Run(
        "cmd", 0, 4, [1.0] * 4, [], [], "", times_ms=times[flags[flags.index("--pipeline-schedule") + 1]]))
    found = multi_gpu.check_timed_against_1f1b(Machine(False, 2, True, None, "/tmp"))
    assert found["status"] == "measured" and found["ratio"] == 10.0, found
    line = gpu_check.verdict([{"name": "timed-against-megatron-1f1b", **found}])
    assert line.startswith("gpu_check: PASS (0 checks passed") and "measured, not judged: timed" in line, line


def test_a_refused_te_split_backward_is_incomplete(monkeypatch, tmp_path):
    """Where Transformer Engine has no split backward for these flags, the run's one-line refusal is what a
    user gets, but it checks nothing of the split: INCOMPLETE. A refusal that trains anyway is FAIL."""
    monkeypatch.setattr(single_gpu, "delays_weight_gradients", lambda **kw: False)
    refusal = "pretrain_gpt.py: error: --transformer-impl transformer_engine: no split backward"
    monkeypatch.setattr(single_gpu, "launch", lambda cmd, env: (2, "", refusal))
    m = Machine(False, 1, True, None, str(tmp_path))
    found = single_gpu.check_te_split_backward(m)
    assert found["status"] == "incomplete" and refusal in found["reason"], found
    monkeypatch.setattr(single_gpu, "launch", lambda cmd, env: (0, "lm loss: 1.0", ""))
    assert single_gpu.check_te_split_backward(m)["status"] == "fail"
