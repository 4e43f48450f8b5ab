"""Model-state bytes per rank, 1F1B against Chimera, measured: the startup line of real launches.

    python -m benchmarks.memory        # 16 launches of up to 8 CPU ranks: a few minutes

For D = 2 and 4, data parallelism 1 and 2, plain fp32 and --bf16 --use-distributed-optimizer, each
launch builds the same GPT (8 layers x 256, tied embeddings), prints Megatron-style "max model state
(bytes) | ..." after setup and trains one iteration. Writes benchmarks/results/memory.json and memory.md
(the README's table) with Chimera over 1F1B per row, and the planner's prediction next to each.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from chimera_schedules import check
from chimera_schedules.ir.spec import ScheduleSpec
from chimera_schedules.registry import REGISTRY
from chimera_schedules.tools.planner import ModelShape, Precision, model_state_bytes
from megatron.chimera.distributed.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--vocab-size", "1000", "--mock-data", "--micro-batch-size", "1",
         "--lr", "1e-4", "--train-iters", "1", "--eval-iters", "0", "--disable-bias-linear"]
PRECISIONS = {"fp32": [], "bf16 + distributed optimizer": ["--bf16", "--use-distributed-optimizer"]}
LINE = re.compile(r"max model state \(bytes\) \| parameters: (\d+) \| main parameters: (\d+) \| gradients: (\d+) \|"
                  r" optimizer: (\d+) \| total: (\d+)")


def measure(schedule: str, depth: int, dp: int, flags: list[str]) -> dict:
    port = str(free_port())
    args = MODEL + ["--pipeline-model-parallel-size", str(depth), "--pipeline-schedule", schedule,
                    "--global-batch-size", str(2 * depth * dp), *flags]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(depth * dp),
                           "--master_port", port, "pretrain_gpt.py", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    found = LINE.search(proc.stdout)
    if proc.returncode or not found:
        sys.exit(f"{schedule} D={depth} DP={dp} {' '.join(flags)} failed:\n{proc.stderr[-3000:]}")
    return dict(zip(("parameters", "main parameters", "gradients", "optimizer", "total"), map(int, found.groups())))


def predicted(schedule: str, depth: int, dp: int, precision: str) -> float:
    """The planner's model state of the busiest worker (stage copies of equal size, embeddings split)."""
    m = dict(zip(MODEL[::2], MODEL[1::2]))
    shape = ModelShape(int(m["--num-layers"]), int(m["--hidden-size"]), int(m["--num-attention-heads"]),
                       int(m["--seq-length"]), int(m["--vocab-size"]))
    spec = check(ScheduleSpec(schedule, depth, depth))
    pipelines = REGISTRY[schedule].pipelines(spec)  # the stage copies each worker holds
    params = (shape.layers // depth) * shape.params_per_layer + shape.embedding_params / depth
    sharded = precision != "fp32"
    return model_state_bytes(params, pipelines, pipelines * dp, Precision(sharded, sharded))["total"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"),
                        help="the folder for memory.json and memory.md")
    out = parser.parse_args().out
    rows = []
    for precision, flags in PRECISIONS.items():
        for depth in (2, 4):
            for dp in (1, 2):
                row = {"precision": precision, "D": depth, "DP": dp}
                for schedule in ("1f1b", "chimera"):
                    row[schedule] = measure(schedule, depth, dp, flags)
                    row[schedule + " predicted"] = predicted(schedule, depth, dp, precision)
                row["chimera/1f1b"] = row["chimera"]["total"] / row["1f1b"]["total"]
                rows.append(row)
                print(f"{precision:<30} D={depth} DP={dp}: 1f1b {row['1f1b']['total']:>10,}  chimera "
                      f"{row['chimera']['total']:>10,}  chimera/1f1b {row['chimera/1f1b']:.2f}x", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "memory.json"), "w") as f:
        json.dump({"model": MODEL, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "memory.md"), "w") as f:
        f.write(markdown(rows))


def markdown(rows: list[dict]) -> str:
    out = ["| precision | D | DP | 1F1B (bytes, largest rank) | Chimera | Chimera / 1F1B | planner: Chimera / 1F1B |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['precision']} | {r['D']} | {r['DP']} | {r['1f1b']['total']:,} | {r['chimera']['total']:,} | "
                   f"{r['chimera/1f1b']:.2f}x | {r['chimera predicted'] / r['1f1b predicted']:.2f}x |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
