"""NCCL communicators per rank, for each schedule at a production shape, from the lowered lists.

    python -m benchmarks.communicators          # D=8, DP=64, TP=8, N=64: a second
    python -m benchmarks.communicators --depth 16 --dp 8 --tp 8

A rank creates one communicator per group it runs collectives on (the world, its tensor-parallel
group, the replica group of each stage it holds, the tied-embedding group on the end stages) and one
per (p2p group, peer) it sends to or receives from. Data and tensor parallelism do not change the p2p
count (each rank talks only to its own slice's workers). The count is given twice: with this
project's channels (one group per direction, chimera_schedules/ir/channels.py) and with the former
one group per pipeline and message kind. Writes benchmarks/results/communicators.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = ("1f1b", "interleaved v=2", "chimera direct", "chimera split", "dualpipe", "dualpipev")


def per_rank(name: str, depth: int, microbatches: int, dp: int, tp: int) -> dict:
    """The busiest rank's communicators, now and with per-pipeline-and-kind groups."""
    from chimera_schedules import build_spec, variant
    from chimera_schedules.analysis.communicators import communicators
    from chimera_schedules.ir.actions import P2P_OPS
    from chimera_schedules.passes.lowering import lower

    lowered = lower(build_spec(variant(name, depth, microbatches)))
    last, rows = lowered.stages_per_pipeline - 1, []
    for w, c in enumerate(communicators(lowered)):
        held = {stage for _, stage in lowered.held(w)}
        copies = {stage: sum(stage in {s for _, s in lowered.held(v)} for v in range(depth)) * dp for stage in held}
        collectives = 1 + (tp > 1) + sum(copies[s] > 1 for s in held) + bool(held & {0, last})
        former = {(a.kind, a.pipeline, a.peer) for a in lowered.workers[w] if a.op in P2P_OPS}
        rows.append({"worker": w, "collectives": collectives, "p2p": len(c.pairs), "p2p_former": len(former)})
    busiest = max(rows, key=lambda r: (r["collectives"] + r["p2p"], r["worker"]))
    return {"schedule": name, "D": depth, "N": microbatches, "DP": dp, "TP": tp, **busiest,
            "total": busiest["collectives"] + busiest["p2p"],
            "total_former": busiest["collectives"] + busiest["p2p_former"]}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.communicators", description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=64)
    p.add_argument("--dp", type=int, default=64)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "communicators.json"))
    args = p.parse_args()
    rows = [per_rank(name, args.depth, args.microbatches, args.dp, args.tp) for name in SCHEDULES]
    print(f"{'schedule':<18}{'worker':>7}{'collective':>11}{'p2p':>5}{'total':>7}"
          f"{'p2p before':>12}{'total before':>14}")
    for r in rows:
        print(f"{r['schedule']:<18}{r['worker']:>7}{r['collectives']:>11}{r['p2p']:>5}{r['total']:>7}"
              f"{r['p2p_former']:>12}{r['total_former']:>14}")
    with open(args.out, "w") as f:
        json.dump({"command": "python -m benchmarks.communicators " + " ".join(sys.argv[1:]), "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
