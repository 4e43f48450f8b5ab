"""Activation memory per rank, measured on real ranks, against the simulator's prediction.

    python -m benchmarks.activation_memory      # 4 CPU ranks, D=4, N=16: about a minute

One launch of D ranks trains the same GPT under 1F1B, Chimera direct, Chimera split and DualPipe.
In each case's second iteration every rank measures, after every action it posts or runs, the bytes
alive in
- autograd's saved tensors (``saved_tensors_hooks`` around every forward step), and
- every tensor our executor holds (its Observer protocol: receive buffers, outputs and gradients not
  yet sent or still in flight, saved stage inputs, gradients a split backward keeps for W),
counting each storage once and leaving parameters out; the peak over the iteration is the row's
measured peak. The ranks talk through the emulated NCCL transport (``--emulate-nccl``), which, like
NCCL, reports a send complete once delivered, so the executor drops it then; torch's gloo p2p work
says so only when waited for. The prediction is the simulator's ``peak_activations`` for the same schedule, with one
micro-batch's bytes per model stage measured in the same run (what one forward of that stage saved):
the simulator says how many micro-batches are alive at once on each worker, the model says how big
one is. A split backward's I also keeps the gradients its W needs; what one I kept is measured the
same way and priced from I to W.
Writes benchmarks/results/activation_memory.json (rows: schedule, D, N, measured_peak_bytes,
predicted_peak_bytes, per rank beside them) and activation_memory.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import weakref

import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

from chimera_schedules import variant
from chimera_schedules.analysis.simulator import peak_activations
from chimera_schedules.ir.actions import Op
from megatron.chimera import Hooks, Trainer, job_config, make_run_plan, parse_args
from megatron.chimera.config.schedule_request import schedule_flags
from megatron.chimera.distributed.ports import free_port
from megatron.chimera.distributed.process_groups import init_distributed
from megatron.chimera.model.gpt_step import forward_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEPTH, MICROBATCHES, TOLERANCE = 4, 16, 0.15
SCHEDULES = ("1f1b", "chimera direct", "chimera split", "dualpipe")
MODEL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "1", "--vocab-size", "512", "--mock-data",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4", "--disable-bias-linear",
         "--train-iters", "2", "--eval-iters", "0", "--emulate-nccl"]


def _storage(t) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def activation_tracker(forward_step):
    """The measurement, through the training loop's hooks protocol and a forward step that records
    what autograd saves."""
    class Tracker(Hooks):
        def __init__(self):
            self.saved, self.forward_saved, self.params = [], {}, set()
            self.measuring, self.peak, self.stage_bytes, self.kept_for_w, self.kept = False, 0, {}, {}, 0

        def forward_step(self, it, model):
            def pack(t):
                # a detached alias: returning ``t`` itself would tie a saved output to its own node in a
                # cycle gc cannot see, keeping retained graphs (a split backward's) alive for good
                alias = t.detach()
                self.saved.append(weakref.ref(alias))
                key, size = _storage(t)
                if key not in self.params:
                    self.forward_saved[key] = size
                return alias
            self.forward_saved = {}
            with saved_tensors_hooks(pack, lambda t: t):
                return forward_step(it, model)

        def before_iteration(self, trainer, iteration):
            self.params = {_storage(p)[0] for m in trainer.models for p in m.parameters()}
            self.measuring, self.peak = iteration == 2, 0

        def after_action(self, action, held):
            tensors = held()
            if action.op is Op.FORWARD:  # what this forward saved: one micro-batch through this stage
                self.stage_bytes[action.stage] = sum(self.forward_saved.values())
            kept = sum(dict(_storage(t) for t in tensors["kept for W"]).values())
            if action.op is Op.BACKWARD_INPUT:  # what this I kept for its W
                self.kept_for_w[action.stage] = kept - self.kept
            self.kept = kept
            if self.measuring:
                self.peak = max(self.peak, self.live_bytes([t for ts in tensors.values() for t in ts]))

        def live_bytes(self, held) -> int:
            """Bytes of every live storage of a saved or held tensor, each once, parameters left out."""
            alive = [t for t in (r() for r in self.saved) if t is not None]
            self.saved = [weakref.ref(t) for t in alive]
            storages = dict(_storage(t) for t in alive + held)
            return sum(size for key, size in storages.items() if key not in self.params)

    return Tracker()


def measure(name: str) -> dict:
    """Two iterations of one schedule on this rank; its measured and predicted peaks."""
    flags = schedule_flags(variant(name, DEPTH, MICROBATCHES), int(MODEL[MODEL.index("--num-layers") + 1]))
    args = parse_args(MODEL + ["--global-batch-size", str(MICROBATCHES)] + flags, world_size=DEPTH)
    tracker = activation_tracker(forward_step)
    job = job_config(args)
    trainer = Trainer(job, make_run_plan(job.pipeline, job.parallel), tracker.forward_step, tracker)
    for i in range(2):
        trainer.train_step(i)
    schedule, worker = trainer.plan.schedule, trainer.rt.worker
    trainer.close()
    return {"measured": tracker.peak, "stage_bytes": tracker.stage_bytes, "kept_for_w": tracker.kept_for_w,
            "schedule": schedule, "worker": worker}


def worker(out: str) -> None:
    init_distributed(None, 10)
    rows = []
    for name in SCHEDULES:
        mine = measure(name)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        stage_bytes = {s: b for g in gathered for s, b in g["stage_bytes"].items()}
        kept = {s: b for g in gathered for s, b in g["kept_for_w"].items()}
        stages = sorted(stage_bytes)
        predicted = peak_activations(mine["schedule"], [stage_bytes[s] for s in stages],
                                     [kept.get(s, 0) for s in stages])
        ranks = [{"worker": g["worker"], "measured_peak_bytes": g["measured"],
                  "predicted_peak_bytes": int(predicted[g["worker"]])} for g in gathered]
        rows.append({"schedule": name, "D": DEPTH, "N": MICROBATCHES,
                     "measured_peak_bytes": max(r["measured_peak_bytes"] for r in ranks),
                     "predicted_peak_bytes": max(r["predicted_peak_bytes"] for r in ranks),
                     "stage_bytes": [stage_bytes[s] for s in stages],
                     "kept_for_w_bytes": [kept.get(s, 0) for s in stages], "per_rank": ranks})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"command": "python -m benchmarks.activation_memory", "model": MODEL, "tolerance": TOLERANCE,
                       "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def report(doc: dict) -> str:
    lines = [f"{'schedule':<16}{'rank':>5}{'measured':>14}{'predicted':>14}{'ratio':>8}"]
    for row in doc["rows"]:
        for r in row["per_rank"]:
            ratio = r["measured_peak_bytes"] / r["predicted_peak_bytes"]
            lines.append(f"{row['schedule']:<16}{r['worker']:>5}{r['measured_peak_bytes']:>14,}"
                         f"{r['predicted_peak_bytes']:>14,}{ratio:>8.3f}")
    worst = max(abs(r["measured_peak_bytes"] / r["predicted_peak_bytes"] - 1) for row in doc["rows"]
                for r in row["per_rank"])
    lines.append(f"largest deviation {worst:.1%} (target: within {doc['tolerance']:.0%} on every rank)")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib  # here, not at the top: only the plot needs it (2 s to import), and Agg must precede pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for i, row in enumerate(doc["rows"]):
        for r in row["per_rank"]:
            x = i * (DEPTH + 1) + r["worker"]
            ax.bar(x - 0.2, r["measured_peak_bytes"] / 2**20, 0.4, color="tab:blue")
            ax.bar(x + 0.2, r["predicted_peak_bytes"] / 2**20, 0.4, color="tab:orange")
    ax.set_xticks([i * (DEPTH + 1) + (DEPTH - 1) / 2 for i in range(len(doc["rows"]))],
                  [r["schedule"] for r in doc["rows"]])
    ax.set_ylabel("peak activation MiB per rank (ranks 0..D-1)")
    ax.legend(["measured", "simulator"])
    ax.set_title(f"D={DEPTH}, N={MICROBATCHES}, GPT {MODEL[1]} layers x {MODEL[3]} hidden, fp32, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.activation_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "activation_memory.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.out)
        return
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(DEPTH),
                           "--master_port", port, "-m", "benchmarks.activation_memory", "--worker", "--out", args.out],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(proc.returncode)
    with open(args.out) as f:
        doc = json.load(f)
    plot(doc, os.path.splitext(args.out)[0] + ".png")
    print(report(doc))


if __name__ == "__main__":
    main()
