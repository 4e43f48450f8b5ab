"""--pipeline-schedule auto under a memory limit that every Chimera plan exceeds: the plan it picks must fit,
and its measured peak per rank must stay under the limit.

    python -m benchmarks.auto_memory      # 4 CPU ranks, D=4: about a minute

The model is benchmarks/activation_memory.py's GPT at D=4 with a global batch of 16, planned by the FLOP
count at this machine's profile (``--pipeline-profile cpu-this-machine``, so that the plan does not move
with a timing). The planner's ranking without a limit gives every plan's predicted peak per worker; the
limit is set 2% under the smallest Chimera plan's, so that Chimera's two stage copies exceed it. Then every
rank parses ``--pipeline-schedule auto --pipeline-memory-limit-gb LIMIT`` as pretrain_gpt.py does and
trains two iterations of the plan it picks. Measured per rank: its model state (parameters, main
parameters, gradients and optimizer state, as the startup line counts them) plus the most activation
bytes it held at once in the second iteration (benchmarks/activation_memory.py's tracker). Writes
benchmarks/results/auto_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch.distributed as dist

from megatron.chimera import Trainer, job_config, make_run_plan, parse_args
from megatron.chimera.config.auto_plan import ranking
from megatron.chimera.distributed.ports import free_port
from megatron.chimera.distributed.process_groups import init_distributed
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.optim.optimizer import model_state_bytes

from .activation_memory import MODEL, activation_tracker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPTH, BATCH, UNDER = 4, 16, 0.98
RUN = [f for f in MODEL if f != "--emulate-nccl"]
RUN = [f for i, f in enumerate(RUN) if f != "--micro-batch-size" and RUN[i - 1] != "--micro-batch-size"]
SIZES = RUN + ["--pipeline-model-parallel-size", str(DEPTH), "--global-batch-size", str(BATCH)]
PROFILE = ["--pipeline-profile", "cpu-this-machine"]
GIB = 2 ** 30


def limit_gb() -> tuple[float, list[dict]]:
    """2% under the smallest predicted peak of a Chimera plan, and every plan's prediction."""
    plans = ranking(parse_args(SIZES + ["--micro-batch-size", "1", "--pipeline-schedule", "1f1b"],
                               world_size=DEPTH))
    rows = [{"plan": c.label, "predicted_ms": 1e3 * c.seconds, "predicted_peak_bytes": c.memory} for c in plans]
    chimera = min(c.memory for c in plans if c.schedule.startswith("chimera"))
    return UNDER * chimera / GIB, rows


def worker(out: str, limit: float) -> None:
    init_distributed(None, 10)
    args = parse_args(SIZES + ["--pipeline-schedule", "auto", "--pipeline-memory-limit-gb", repr(limit)] + PROFILE,
                      world_size=DEPTH)
    tracker = activation_tracker(forward_step)
    job = job_config(args)
    trainer = Trainer(job, make_run_plan(job.pipeline, job.parallel), tracker.forward_step, tracker)
    for i in range(2):
        trainer.train_step(i)
    state = sum(model_state_bytes(trainer.models, trainer.main, trainer.optimizer))
    trainer.close()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"rank": dist.get_rank(), "model_state_bytes": state,
                                   "activation_peak_bytes": tracker.peak, "peak_bytes": state + tracker.peak})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"plan": args.pipeline_plan, "per_rank": every}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    limit, plans = limit_gb()
    part = os.path.join(ROOT, "benchmarks", "results", "auto_memory.ranks.json")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(DEPTH),
                           "--master_port", str(free_port()), "-m", "benchmarks.auto_memory", "--worker", part,
                           "--limit", repr(limit)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        sys.exit(f"the auto run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(part) as f:
        measured = json.load(f)
    os.remove(part)
    peak = max(r["peak_bytes"] for r in measured["per_rank"])
    picked = " ".join(measured["plan"])
    doc = {"command": "python -m benchmarks.auto_memory", "limit_gib": limit, "limit_bytes": limit * GIB,
           "picked": picked, "measured_peak_bytes": peak, "under_limit": peak <= limit * GIB,
           "chimera_picked": "chimera" in picked, **measured, "plans": plans}
    with open(os.path.join(ROOT, "benchmarks", "results", "auto_memory.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"limit {limit * GIB / 2**20:.3f} MiB (2% under Chimera's smallest predicted peak); picked {picked}; "
          f"measured peak {peak / 2**20:.3f} MiB: {'under' if doc['under_limit'] else 'OVER'} the limit")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="OUT")
    parser.add_argument("--limit", type=float)
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.limit)
    else:
        main()
