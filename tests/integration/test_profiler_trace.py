"""Profiler ranges on every action: a profiled 2-rank run writes, per rank, a trace whose ``PP:`` ranges
are that worker's lowered list, one range per action and in order (the executor's side, in one
process, is tests/unit/test_profiler_ranges.py)."""
import json

from megatron.chimera.config.arguments import parse_args
from megatron.chimera.config.run_plan import make_run_plan
from megatron.chimera.testing.launch import run

CHIMERA2 = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "128", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
            "chimera", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--lr-decay-style", "constant", "--train-iters", "2", "--eval-iters", "1"]


def pp_ranges(events) -> list[str]:
    """The names of a trace's ``PP:`` ranges, in the order they started."""
    return [e["name"] for e in sorted(events, key=lambda e: e["ts"]) if e.get("name", "").startswith("PP:")]


def test_a_profiled_two_rank_run_traces_one_range_per_action_of_each_worker(tmp_path):
    """Megatron-LM's profiler flags on iteration 2: each rank's trace holds its worker's lowered list."""
    run(2, "pretrain_gpt.py", *CHIMERA2, "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
        "--profile-step-end", "2", "--profile-ranks", "0", "1", "--tensorboard-dir", str(tmp_path))
    lowered = make_run_plan(parse_args(CHIMERA2, world_size=2)).lowered
    traces = {}
    for path in tmp_path.glob("*.pt.trace.json"):
        trace = json.loads(path.read_text())
        traces[trace["distributedInfo"]["rank"]] = pp_ranges(trace["traceEvents"])
    assert sorted(traces) == [0, 1]
    for rank, names in traces.items():  # world 2, PP 2: worker = rank
        assert names == [f"PP:{a}" for a in lowered.workers[rank]], (rank, names)
