"""How long --pipeline-schedule auto takes to plan, and what it picks, at each pipeline depth.

    python -m benchmarks.planning_time [--depths 8,16] [--profile h100-datasheet]

pretrain_gpt.py's own argument parsing (megatron/chimera/arguments.py) of GPT-2 1.3B's shape (the Chimera
paper's: 64 layers, hidden 1280, sequence 632, bf16) at PP = D, DP = 1 and a global batch of 4D, with
--pipeline-schedule auto, in this one process (no ranks are started: the plan is a function of the flags).
The time is the whole parse with planning, after one warm-up parse that pays the imports. Writes
benchmarks/results/planning_time.json: per depth, the seconds, the printed plan line and the startup table.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time

from megatron.chimera.arguments import parse_args

GPT2_1_3B = ["--num-layers", "64", "--hidden-size", "1280", "--num-attention-heads", "20", "--seq-length", "632",
             "--max-position-embeddings", "632", "--vocab-size", "50257", "--mock-data", "--train-iters", "2",
             "--lr", "1e-4", "--bf16", "--transformer-impl", "local"]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "planning_time.json")


def planned(depth: int, profile: str) -> dict:
    """One auto parse at PP = ``depth``: its seconds and what it printed of the plan."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        start = time.perf_counter()
        parse_args(GPT2_1_3B + ["--pipeline-model-parallel-size", str(depth), "--global-batch-size", str(4 * depth),
                                "--pipeline-schedule", "auto", "--pipeline-profile", profile], world_size=depth)
        seconds = time.perf_counter() - start
    lines = printed.getvalue().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(" > pipeline plans"))
    last = next(i for i, line in enumerate(lines) if line.startswith(" > pipeline plan:"))
    return {"depth": depth, "seconds": seconds, "plan": lines[last], "table": lines[first:last]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="8,16")
    parser.add_argument("--profile", default="h100-datasheet")
    options = parser.parse_args()
    with contextlib.redirect_stdout(io.StringIO()):  # the imports, paid once
        parse_args(GPT2_1_3B + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                                "--micro-batch-size", "1"], world_size=2)
    results = [planned(int(d), options.profile) for d in options.depths.split(",")]
    for r in results:
        print(f"D={r['depth']}: {r['seconds']:.2f} s", *r["table"], r["plan"], sep="\n")
    with open(OUT, "w") as f:
        json.dump({"command": "python -m benchmarks.planning_time --depths " + options.depths, "model": "GPT-2 1.3B",
                   "profile": options.profile, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
