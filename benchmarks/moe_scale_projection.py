"""Predicted throughput of Chimera, Chimera split and DualPipe against 1F1B and interleaved for a
DeepSeek-V3-sized mixture of experts on 2,048 GPUs, each at its best depth, expert parallelism and
micro-batch size, under a hardware profile.

    python -m benchmarks.moe_scale_projection --profile profiles/h100-datasheet.json

A prediction, not a measurement: it rests on the profile's datasheet numbers and on the planner's cost
model (chimera_schedules/tools/planner.py: expert FLOPs, the dispatch and combine all-to-all, expert
memory per expert-parallel rank), whose schedule simulator is checked against real runs by
python -m benchmarks.quick. Writes benchmarks/results/moe_scale_projection.{md,json,png}.
"""
import argparse
import json
import os

from chimera_schedules.tools.planner import Experts, ModelShape, Precision, Profile, best_per_schedule, family, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# DeepSeek-V3's sizes, with 64 layers (V3 has 61, the first 3 dense) so that 8, 16 and 32 stages divide
# them; attention priced as standard attention (V3's MLA computes less), flash attention (no stored scores).
DEEPSEEK_V3 = ModelShape(layers=64, hidden=7168, heads=128, seq=4096, vocab=129280, ffn=18432, gated=True,
                         experts=Experts(count=256, topk=8, ffn=2048, moe_layers=61, shared_ffn=2048),
                         stores_attention_scores=False)
SCHEDULES = ("1f1b", "interleaved v=2", "chimera direct", "chimera split", "dualpipe")
DEPTHS = (8, 16, 32)
EXPERT_PARALLEL = (8, 16, 32, 64)


def main():
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_scale_projection", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=os.path.join(ROOT, "profiles", "h100-datasheet.json"))
    p.add_argument("--workers", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=4096, help="sequences per iteration")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args()
    profile = Profile.load(args.profile)
    ranked = plan(args.workers, args.global_batch, DEEPSEEK_V3, profile, depths=DEPTHS, micro_batches=(1, 2),
                  precision=Precision(half=True, distributed_optimizer=True), schedules=SCHEDULES,
                  expert_parallel=EXPERT_PARALLEL)
    rows = [{"schedule": family(c.schedule), "layout": c.label, "depth": c.depth, "expert_parallel": c.expert_parallel,
             "tokens_per_s": c.tokens_per_s, "seconds": c.seconds, "bubble_ratio": c.bubble_ratio,
             "memory_gib": c.memory / 2**30, "fits": c.fits} for c in ranked]
    best = best_per_schedule(ranked)
    lines = _markdown(best, ranked, args, profile)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_scale_projection.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "moe_scale_projection.json"), "w") as f:
        json.dump({"prediction": True, "profile": profile.__dict__, "workers": args.workers,
                   "global_batch": args.global_batch, "model": {**DEEPSEEK_V3.__dict__,
                                                                "experts": DEEPSEEK_V3.experts.__dict__},
                   "best": {s: c.label for s, c in best.items()}, "rows": rows}, f, indent=1)
    _plot(rows, profile, os.path.join(args.out, "moe_scale_projection.png"))
    print("\n".join(lines))


def _markdown(best: dict, ranked: list, args, profile) -> list[str]:
    base = max((best[s].tokens_per_s for s in ("1f1b", "interleaved") if s in best), default=0)
    lines = [f"# Scale projection: a DeepSeek-V3-sized MoE on {args.workers:,} GPUs (predicted, not measured)\n",
             f"Profile: {profile.name}. {profile.source}\n",
             f"Model: 64 layers (61 MoE: 256 experts, top-8, width 2048, one shared expert), hidden 7168, "
             f"sequence 4096; bf16 with the distributed optimizer; global batch {args.global_batch} sequences. "
             "Each row: the schedule's fastest layout that fits in memory over depths 8, 16, 32, expert "
             "parallelism 8 to 64 and micro-batch sizes 1 and 2.\n",
             "| schedule | best layout | tokens/s | bubble | memory (GiB) | over the best of 1F1B and interleaved |",
             "|---|---|---|---|---|---|"]
    for s, c in best.items():
        ratio = f"{c.tokens_per_s / base:.2f}x" if base else "-"
        lines.append(f"| {s} | {c.label} | {c.tokens_per_s:,.0f} | {c.bubble_ratio:.3f} | {c.memory / 2**30:.1f} "
                     f"| {ratio} |")
    for s in dict.fromkeys(family(c.schedule) for c in ranked):
        if s not in best:  # nothing fits: its fastest layout, and what it would need
            c = max((c for c in ranked if family(c.schedule) == s), key=lambda c: c.tokens_per_s)
            lines.append(f"| {s} | none fits; fastest: {c.label} | ({c.tokens_per_s:,.0f}) | {c.bubble_ratio:.3f} "
                         f"| {c.memory / 2**30:.1f} | - |")
    return lines


def _plot(rows: list[dict], profile, path: str) -> None:
    import matplotlib  # here, not at the top: only the plot needs it (2 s to import), and Agg must precede pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for s in dict.fromkeys(r["schedule"] for r in rows):
        pts = {}
        for r in rows:
            if r["schedule"] == s and r["fits"]:
                pts[r["depth"]] = max(pts.get(r["depth"], 0), r["tokens_per_s"])
        if pts:
            ax.plot(*zip(*sorted(pts.items())), marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pipeline depth D")
    ax.set_ylabel("predicted tokens/s (best fitting layout)")
    ax.legend(fontsize=8)
    ax.set_title(f"DeepSeek-V3-sized MoE, 2,048 GPUs, predicted under {profile.name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
