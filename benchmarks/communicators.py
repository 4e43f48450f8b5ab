"""NCCL communicators per rank, for each schedule at a production shape, from the lowered lists.

    python -m benchmarks.communicators          # D=8, DP=64, N=64: a second
    python -m benchmarks.communicators --depth 4 --dp 1

A rank creates one communicator per process group it runs collectives on (the world, its tensor-parallel
group, the replica group of each stage it holds, the tied-embedding group on the end stages) and one
per (p2p group, peer) it sends to or receives from. The trainer gives groups with one rank set one
process group: Chimera's stage s and stage D-1-s replica groups and the embedding group are one
communicator. Data and tensor parallelism do not change the p2p count (each rank talks only to its own
slice's workers), nor tensor parallelism the collective one. Each count is also given as it was before:
collective groups unshared, p2p with one group per pipeline and message kind, this project's former
channels (chimera_schedules/ir/channels.py). Writes benchmarks/results/communicators.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from chimera_schedules import build_spec, variant
from chimera_schedules.analysis.communicators import collective_groups, communicators
from chimera_schedules.ir.actions import P2P_OPS
from chimera_schedules.passes.lowering import lower

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = ("1f1b", "interleaved v=2", "chimera direct", "chimera split", "dualpipe", "dualpipev")


def per_rank(name: str, depth: int, microbatches: int, dp: int) -> dict:
    """The most communicators on any rank (as the trainer's startup line counts them), now and before
    (unshared groups, per-pipeline-and-kind p2p)."""
    lowered = lower(build_spec(variant(name, depth, microbatches)))
    rows = []
    for w, c in enumerate(communicators(lowered)):
        groups = collective_groups(lowered, w, dp)
        former = {(a.kind, a.pipeline, a.peer) for a in lowered.workers[w] if a.op in P2P_OPS}
        rows.append({"collectives": len(set(groups.values())), "collectives_unshared": len(groups),
                     "p2p": len(c.pairs), "p2p_former": len(former)})
    most = {key: max(r[key] for r in rows) for key in rows[0]}
    return {"schedule": name, "D": depth, "N": microbatches, "DP": dp, **most,
            "total": max(r["collectives"] + r["p2p"] for r in rows),
            "total_former": max(r["collectives_unshared"] + r["p2p_former"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.communicators", description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=64)
    p.add_argument("--dp", type=int, default=64)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "communicators.json"))
    args = p.parse_args()
    rows = [per_rank(name, args.depth, args.microbatches, args.dp) for name in SCHEDULES]
    print(f"{'schedule':<18}{'collective':>11}{'unshared':>9}{'p2p':>5}{'total':>7}"
          f"{'p2p before':>12}{'total before':>14}")
    for r in rows:
        print(f"{r['schedule']:<18}{r['collectives']:>11}{r['collectives_unshared']:>9}{r['p2p']:>5}"
              f"{r['total']:>7}{r['p2p_former']:>12}{r['total_former']:>14}")
    with open(args.out, "w") as f:
        json.dump({"command": "python -m benchmarks.communicators " + " ".join(sys.argv[1:]), "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
