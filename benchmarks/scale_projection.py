"""Predicted throughput of each schedule for GPT-2 1.3B (64 layers, hidden 1280, 20 heads, sequence 632,
as in the paper) for pipeline depth D from 4 to 64 and up to 2,048 workers, under a hardware profile.

    python -m benchmarks.scale_projection --profile profiles/piz-daint-p100.json

A prediction, not a measurement: it rests on the profile's numbers and on the planner's cost model
(chimera_schedules/tools/planner.py), whose schedule simulator is checked against real runs by
python -m benchmarks.quick. Writes benchmarks/results/scale_projection.{md,json,png} (with
``--batch-per-worker K`` other than 1: benchmarks/results/scale_projection_batchK.*).
"""
import argparse
import json
import os

from chimera_schedules.tools.planner import GPT2_1_3B, Profile, best_per_schedule, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GPT2 = GPT2_1_3B
DEPTHS = (4, 8, 16, 32, 64)
SHOWN = ("gpipe", "1f1b", "chimera", "1f1b split", "chimera split", "dualpipe")  # planner.family names


def _ratio(cells: dict, schedule: str, others: tuple[str, ...]) -> str:
    base = max(cells.get(o, 0) for o in others)
    return f"{cells[schedule] / base:.2f}x" if base and schedule in cells else "-"


def main():
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_projection", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=os.path.join(ROOT, "profiles", "piz-daint-p100.json"))
    p.add_argument("--workers", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--batch-per-worker", type=int, default=1, help="global batch = workers x this")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args()
    profile = Profile.load(args.profile)
    rows = _rows(args.workers, args.batch_per_worker, profile)
    lines = _markdown(rows, args.workers, args.batch_per_worker, profile)
    os.makedirs(args.out, exist_ok=True)
    name = "scale_projection" + (f"_batch{args.batch_per_worker}" if args.batch_per_worker != 1 else "")
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"profile": profile.__dict__, "model": GPT2.__dict__, "rows": rows}, f, indent=1)
    _plot(rows, args.workers, profile, os.path.join(args.out, name + ".png"))
    print("\n".join(lines))


def _rows(worker_counts: list[int], batch_per_worker: int, profile) -> list[dict]:
    """The best layout of each schedule at each depth and worker count, as the planner predicts it."""
    rows = []
    for workers in worker_counts:
        for d in DEPTHS:
            ranked = plan(workers, workers * batch_per_worker, GPT2, profile, depths=[d])
            for schedule, c in best_per_schedule(ranked).items():
                rows.append({"workers": workers, "depth": d, "schedule": schedule, "layout": c.label,
                             "tokens_per_s": c.tokens_per_s, "seconds": c.seconds, "memory_gib": c.memory / 2**30})
    return rows


def _markdown(rows: list[dict], worker_counts: list[int], batch_per_worker: int, profile) -> list[str]:
    lines = ["# Scale projection: GPT-2 1.3B (predicted, not measured)\n",
             f"Profile: {profile.name}. {profile.source}\n",
             f"Global batch = workers x {batch_per_worker} sequence(s) of 632 tokens. Each cell: the best layout "
             "of that schedule at that depth (micro-batch size 1, 2, 4 or 8), in tokens/s; - where no layout fits in "
             "memory or the schedule's rules allow none (DualPipe needs N >= 2D micro-batches).\n",
             "| workers | D | " + " | ".join(SHOWN) + " | chimera / best other | chimera split / chimera "
             "| chimera split / dualpipe |", "|---|---|" + "---|" * (len(SHOWN) + 3)]
    for workers in worker_counts:
        for d in DEPTHS:
            cells = {r["schedule"]: r["tokens_per_s"] for r in rows if r["workers"] == workers and r["depth"] == d}
            ratios = [_ratio(cells, "chimera", ("gpipe", "1f1b")), _ratio(cells, "chimera split", ("chimera",)),
                      _ratio(cells, "chimera split", ("dualpipe",))]
            lines.append(f"| {workers} | {d} | " + " | ".join(f"{cells[s]:,.0f}" if s in cells else "-"
                                                              for s in SHOWN) + " | " + " | ".join(ratios) + " |")
    return lines + _best_layouts(rows, worker_counts)


def _best_layouts(rows: list[dict], worker_counts: list[int]) -> list[str]:
    """Per worker count and schedule, its best layout over every depth, and Chimera's speedups over it."""
    best = {}
    for r in rows:
        key = (r["workers"], r["schedule"])
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r
    lines = ["\nBest layout per schedule and worker count:\n",
             "| workers | schedule | layout | tokens/s | chimera speedup | chimera split speedup |",
             "|---|---|---|---|---|---|"]
    for workers in worker_counts:
        for s in SHOWN:
            r = best.get((workers, s))
            if r:
                speed = [best[(workers, c)]["tokens_per_s"] / r["tokens_per_s"] if (workers, c) in best else 0
                         for c in ("chimera", "chimera split")]
                lines.append(f"| {workers} | {s} | {r['layout']} | {r['tokens_per_s']:,.0f} | {speed[0]:.2f}x "
                             f"| {speed[1]:.2f}x |")
    return lines


def _plot(rows: list[dict], worker_counts: list[int], profile, path: str) -> None:
    import matplotlib  # here, not at the top: only the plot needs it (2 s to import), and Agg must precede pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(worker_counts), figsize=(4 * len(worker_counts), 3.6), sharey=False)
    for ax, workers in zip(axes, worker_counts):
        for s in SHOWN:
            pts = [(r["depth"], r["tokens_per_s"]) for r in rows if r["workers"] == workers and r["schedule"] == s]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{workers} workers")
        ax.set_xlabel("pipeline depth D")
    axes[0].set_ylabel("predicted tokens/s")
    axes[0].legend()
    fig.suptitle(f"GPT-2 1.3B, predicted under {profile.name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
