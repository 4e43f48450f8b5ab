"""Benchmark pipeline schedules side by side on the same GPT and data, measured the same way in one run.

    python -m benchmarks.quick --quick          # 2 CPU ranks, D=2, N = 2, 4, 8: a few minutes

One launch of 2 ranks (one thread each: all this 2-core machine runs in parallel) runs every case:
our gpipe, 1f1b, interleaved and chimera (direct, doubling, best), the split-backward schedules (1f1b
and chimera with --split-backward, DualPipe), megatron-core's 1F1B, and plain data parallelism over
the same ranks. Per case it measures the median, min and max iteration time
after warm-up, tokens/s, the bubble ratio from per-action timestamps on every rank, peak activation
bytes (saved-tensor accounting) and weight bytes per rank. The simulator, fed with this run's
measured per-stage forward/backward times (I and W for a split backward), p2p latency and all-reduce time,
replays the lowered schedule (what the executor posts) under gloo's rules and predicts each schedule's
bubbles and iteration time next to the measurement. Each rank has one core here, so all-reduces are priced as
occupying it (``CostModel.collectives_use_compute``). Process groups are freed after every case: idle
gloo groups poll, and leaked ones slowed later cases.

Writes benchmarks/results/<name>.json, <name>.md (the README's tables), <name>_throughput.png,
<name>_timeline_*.png and Perfetto traces in benchmarks/results/traces/.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import date

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd.graph import saved_tensors_hooks

from chimera_schedules import Action, ConfigError, CostModel, build, check, simulate, variant
from chimera_schedules.analysis.measure import measured_result
from chimera_schedules.ir.costs import Event
from chimera_schedules.passes.lowering import lower
from chimera_schedules.tools.planner import ModelShape
from chimera_schedules.tools.render import perfetto_trace, png_timeline
from megatron.chimera import Hooks, Trainer, job_config, make_run_plan, parse_args
from megatron.chimera.config.schedule_request import schedule_flags
from megatron.chimera.distributed.ports import free_port
from megatron.chimera.distributed.process_groups import init_distributed
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.optim.optimizer import model_state_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUICK = {"microbatches": [2, 4, 8], "stages": 2, "rounds": 3, "warmup": 2, "iters": 4,
         "model": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
                   "--max-position-embeddings", "128", "--micro-batch-size", "2", "--vocab-size", "1000",
                   "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
                   "--disable-bias-linear"]}


BENCHMARKED = ("gpipe", "1f1b", "interleaved v=2", "chimera direct", "chimera doubling", "chimera best",
               "1f1b split", "chimera split", "dualpipe", "dualpipev")
DISTOPT = " +distopt"  # the same schedule with --use-distributed-optimizer --overlap-param-gather
# Every case overlaps its gradient reductions with the backward, as Megatron-LM's recipes ask
# (megatron-core's 1F1B and data parallelism through its no_sync/grad_sync hooks, ours at R actions)
OVERLAP = ["--overlap-grad-reduce"]


def cases(cfg: dict) -> list[tuple[str, int, list[str]]]:
    """(label, N, flags) for every schedule the sizes allow: the registry's variants named in
    BENCHMARKED, megatron-core's 1F1B and data parallelism."""
    d, layers = cfg["stages"], int(cfg["model"][cfg["model"].index("--num-layers") + 1])
    out = []
    for n in cfg["microbatches"]:
        batch = ["--global-batch-size", str(n * 2)]  # micro-batches of 2 on one pipeline: N of them
        for name in BENCHMARKED:
            spec = variant(name, d, n)
            try:
                check(spec)
            except ConfigError:
                continue
            out.append((name, n, batch + schedule_flags(spec, layers)))
            if (name.startswith("chimera") or name == "1f1b") and "split" not in name:
                out.append((name + DISTOPT, n, batch + schedule_flags(spec, layers)
                            + ["--use-distributed-optimizer", "--overlap-param-gather"]))
        out.append(("megatron-1f1b", n, batch + ["--pipeline-model-parallel-size", str(d),
                                                 "--pipeline-schedule", "megatron-1f1b"]))
        if n >= d:  # data parallelism over the same 2 ranks: the whole model on each
            out.append(("data-parallel", n, batch))
    only = cfg.get("only", "")
    return [c for c in out if only in c[0] or c[0] == "1f1b"]


# ----------------------------------------------------------------------------------------- worker side
def _comm_costs(device):
    """Median one-way p2p time of an activation, and the time of one stage's gradient reduction as
    GradSync does it: flatten, all-reduce, copy back (each rank has one core: the copies cost too)."""
    rank = dist.get_rank()
    act = torch.zeros(128, 2, 256, device=device)
    grads = [torch.zeros(256, 256, device=device) for _ in range(2 * 12)]  # 2 layers of 12 h^2 parameters
    rtts, reds = [], []
    for _ in range(20):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(act, 1)
            dist.recv(act, 1)
        else:
            dist.recv(act, 0)
            dist.send(act, 0)
        rtts.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
        reds.append(time.perf_counter() - t)
    return statistics.median(rtts) / 2, statistics.median(reds)


def _case_args(flags, cfg):
    return parse_args(cfg["model"] + ["--train-iters", str(cfg["warmup"] + cfg["iters"])] + OVERLAP + flags,
                      world_size=2)


def _timing(forward_step):
    """The benchmark's view of each iteration, through the training loop's hooks protocol: the pipeline
    span (from its first action to its flush), every compute action relative to its start, the bytes
    each forward saved (warm-up iterations only), and the time after the flush: the loss all-reduce,
    the gradient norm, clipping, AdamW and the distributed optimizer's weight all-gather."""
    class Timing(Hooks):
        def __init__(self):
            self.t0 = self.flushed = 0.0
            self.counting, self.bytes = False, 0
            self.events, self.saved_bytes = [], {}

        def before_iteration(self, trainer, iteration):
            self.t0 = time.perf_counter()

        def after_backward(self, trainer, iteration):
            self.flushed = time.perf_counter()

        def on_action(self, action, start, end):
            self.events.append((action, start - self.t0, end - self.t0))
            if action.op.value == "F" and self.counting:
                self.saved_bytes[(action.pipeline, action.stage, action.mb)] = self.bytes

        def counting_forward_step(self, it, model):
            """Counts saved bytes in the warm-up iterations only: saved-tensor hooks slow the backward
            (a split one most), so the measured iterations run without them."""
            if not self.counting:
                return forward_step(it, model)

            def pack(t):
                self.bytes += t.numel() * t.element_size()
                return t.detach()  # not ``t``: a saved output would hold its own node in a cycle
            self.bytes = 0
            with saved_tensors_hooks(pack, lambda t: t):
                return forward_step(it, model)

        def step(self, trainer, i: int) -> dict:
            """One iteration's step, pipeline-span and after-flush seconds, and its events."""
            self.events = []
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step(i)
            end = time.perf_counter()
            return {"steps": end - start, "spans": self.flushed - self.t0, "optimizer": end - self.flushed,
                    "events": [(str(a), s, e) for a, s, e in self.events]}

    return Timing()


def _measure_case(flags, cfg):
    """Train ``cfg["warmup"] + cfg["iters"]`` iterations of one case; rank 0 gets every rank's step and
    pipeline-span times, per-action timestamps and saved bytes of the measured iterations."""
    args = _case_args(flags, cfg)
    timing = _timing(forward_step)
    job = job_config(args)
    trainer = Trainer(job, make_run_plan(job.pipeline, job.parallel), timing.counting_forward_step, timing)
    measured = {"steps": [], "spans": [], "optimizer": [], "events": []}
    for i in range(cfg["warmup"] + cfg["iters"]):
        timing.counting = i < cfg["warmup"]
        times = timing.step(trainer, i)
        if i >= cfg["warmup"]:
            for key, value in times.items():
                measured[key].append(value)
    # every rank's numbers to rank 0
    mine = {**measured, "saved": {f"{k[0]},{k[1]},{k[2]}": v for k, v in timing.saved_bytes.items()},
            "weights": sum(p.numel() * p.element_size() for m in trainer.models for p in m.parameters()),
            "model_state": sum(model_state_bytes(trainer.models, trainer.main, trainer.optimizer)),
            "schedule": trainer.plan.schedule}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    trainer.close()  # idle gloo groups poll: leaked ones would slow every later case
    return (args, gathered) if dist.get_rank() == 0 else None


def _merge(rounds: list[list[dict]]) -> list[dict]:
    """Per rank, the measured iterations of every round, in order."""
    merged = []
    for per_round in zip(*rounds):
        merged.append({"steps": [x for g in per_round for x in g["steps"]],
                       "spans": [x for g in per_round for x in g["spans"]],
                       "optimizer": [x for g in per_round for x in g["optimizer"]],
                       "events": [x for g in per_round for x in g["events"]],
                       "saved": per_round[0]["saved"], "weights": per_round[0]["weights"],
                       "schedule": per_round[0]["schedule"],
                       "model_state": per_round[0]["model_state"]})
    return merged


def _summarize(label, n, args, rounds, cfg, comm):
    """One result row from the measured iterations of every round: times, ratios' raw material, the
    measured timeline of the median iteration, and the simulator's prediction from this run's costs."""
    gathered = _merge(rounds)
    iters = len(gathered[0]["steps"])
    step_times = [max(g["steps"][i] for g in gathered) for i in range(iters)]
    span_times = [max(g["spans"][i] for g in gathered) for i in range(iters)]
    median = statistics.median(step_times)
    per_round = cfg["iters"]
    round_medians = [statistics.median(step_times[k:k + per_round]) * 1e3 for k in range(0, iters, per_round)]
    overhead = statistics.median(s - p for s, p in zip(step_times, span_times))
    row = {"schedule": label, "N": n, "iteration_ms": {"median": median * 1e3, "min": min(step_times) * 1e3,
                                                        "max": max(step_times) * 1e3},
           "tokens_per_s": args.global_batch_size * args.seq_length / median,
           "round_medians_ms": round_medians,
           "weight_bytes": [g["weights"] for g in gathered], "model_state_bytes": [g["model_state"] for g in gathered],
           "step_overhead_ms": overhead * 1e3,
           "optimizer_ms": statistics.median(max(g["optimizer"][i] for g in gathered) for i in range(iters)) * 1e3}
    schedule = gathered[0]["schedule"]
    if schedule is not None:
        # the median iteration's events, all ranks, in ms
        pick = sorted(range(iters), key=lambda i: span_times[i])[iters // 2]
        evs = [Event(w, Action.parse(a), s * 1e3, e * 1e3) for w, g in enumerate(gathered)  # DP=TP=1: rank = worker
               for a, s, e in g["events"][pick]]
        saved = {tuple(int(x) for x in k.split(",")): v for g in gathered for k, v in g["saved"].items()}
        measured = measured_result(schedule, evs, span_times[pick] * 1e3, saved)
        costs = _stage_costs(gathered, args, schedule)
        model = CostModel(forward=costs["forward"], backward=costs["backward"], weight=costs.get("weight"),
                          p2p_latency=comm["p2p_ms"], allreduce_latency=comm["allreduce_ms"] / 2,
                          collectives_use_compute=True)
        predicted = simulate(lower(schedule), model, "gloo")  # what the executor posts, priced under gloo
        row.update({"bubble_measured": measured.bubble_ratio, "bubble_predicted": predicted.bubble_ratio,
                    "pipeline_ms": span_times[pick] * 1e3, "predicted_pipeline_ms": predicted.makespan,
                    "predicted_ms": predicted.makespan + overhead * 1e3,
                    "peak_activation_bytes": measured.peak_activations, "costs_ms": costs,
                    "_measured": measured, "_predicted": predicted})
    return row


def _stage_costs(gathered, args, schedule):
    """Median forward and backward time (ms) per model stage, over all measured iterations. A split
    backward's time is I + W, and W its weight part; where a stage runs both whole and split
    backwards (DualPipe), the backward is the mean of the two."""
    per = {}
    for g in gathered:
        for it in g["events"]:
            for a, s, e in it:
                act = Action.parse(a)
                per.setdefault((act.op.value, act.stage), []).append((e - s) * 1e3)
    med = {key: statistics.median(times) for key, times in per.items()}
    stages = range(schedule.stages_per_pipeline)
    out = {"forward": [med[("F", s)] for s in stages]}
    if not any(op == "W" for op, _ in med):
        return {**out, "backward": [med[("B", s)] for s in stages]}
    backward, weight = [], []
    for s in stages:
        times = [med[("B", s)]] if ("B", s) in med else []
        times += [med[("I", s)] + med[("W", s)]] if ("W", s) in med else []
        backward.append(statistics.mean(times))
        weight.append(med.get(("W", s), backward[-1] / 2))
    return {**out, "backward": backward, "weight": weight}


def _predict_baselines(rows, comm):
    """megatron-1f1b runs our 1F1B's schedule with the same costs; data parallelism runs the whole model
    per rank (the sum of the stage costs) and all-reduces all of it once per iteration."""
    ours = {r["N"]: r for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        base = ours.get(r["N"])
        if base is None or "bubble_predicted" in r:
            continue
        c = base["costs_ms"]
        if r["schedule"] == "megatron-1f1b":
            pred = simulate(build("1f1b", 2, r["N"]), CostModel(forward=c["forward"], backward=c["backward"],
                                                                p2p_latency=comm["p2p_ms"]))
            r.update({"bubble_predicted": pred.bubble_ratio, "predicted_pipeline_ms": pred.makespan})
        else:
            micro = r["N"] // 2  # global batch 2N samples: N micro-batches of 2, half on each replica
            f, b = sum(c["forward"]), sum(c["backward"])
            r.update({"bubble_predicted": 0.0,
                      "predicted_pipeline_ms": micro * (f + b) + comm["allreduce_ms"] * 2})  # whole model = 2 stages
        r["predicted_ms"] = r["predicted_pipeline_ms"] + r["step_overhead_ms"]


def worker(cfg: dict, out: str, name: str) -> None:
    init_distributed(None, 10)
    p2p, allreduce = _comm_costs(torch.device("cpu"))
    comm = {"p2p_ms": p2p * 1e3, "allreduce_ms": allreduce * 1e3}
    todo = cases(cfg)
    raw = {i: [] for i in range(len(todo))}
    for r in range(cfg["rounds"]):  # every case in every round: a slow spell of the machine hits all alike
        for i, (label, n, flags) in enumerate(todo):
            result = _measure_case(flags, cfg)
            if result is not None:
                args, gathered = result
                raw[i].append(gathered)
                step = statistics.median(max(g["steps"][k] for g in gathered) for k in range(cfg["iters"]))
                print(f"[round {r + 1}/{cfg['rounds']}, {i + 1:2d}/{len(todo)}] {label:<17} N={n}: "
                      f"{step * 1e3:7.1f} ms/iter", flush=True)
    if dist.get_rank() == 0:
        rows = [_summarize(label, n, _case_args(flags, cfg), raw[i], cfg, comm)
                for i, (label, n, flags) in enumerate(todo)]
        _predict_baselines(rows, comm)
        write_outputs(rows, comm, cfg, out, name)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- outputs
def ratios(rows: list[dict]) -> dict:
    """Throughput of chimera direct over each baseline, and of the best Chimera variant over the faster
    of our 1F1B and megatron-core's, per N."""
    by = {(r["schedule"], r["N"]): r for r in rows}
    out = {}
    for n in sorted({r["N"] for r in rows}):
        c = by.get(("chimera direct", n))
        for base in ("1f1b", "megatron-1f1b", "gpipe", "data-parallel"):
            if c and (base, n) in by:
                out[f"chimera/{base} N={n}"] = c["tokens_per_s"] / by[(base, n)]["tokens_per_s"]
        chimeras = [r for r in rows if r["N"] == n and r["schedule"].startswith("chimera")]
        one_f_one_bs = [r for r in rows if r["N"] == n and r["schedule"] in ("1f1b", "megatron-1f1b")]
        if chimeras and one_f_one_bs:
            best = max(chimeras, key=lambda r: r["tokens_per_s"])
            base = max(one_f_one_bs, key=lambda r: r["tokens_per_s"])
            out[f"best chimera/best 1f1b N={n}"] = best["tokens_per_s"] / base["tokens_per_s"]
            out[f"best chimera/best 1f1b N={n} pair"] = f"{best['schedule']} / {base['schedule']}"
            out[f"best chimera/best 1f1b N={n} per round"] = [
                b / c for b, c in zip(base["round_medians_ms"], best["round_medians_ms"])]
        out.update(_distopt_ratios(by, n))
        out.update(_split_ratios(by, n))
    return out


SPLIT_PAIRS = (("chimera split", "chimera direct"), ("1f1b split", "1f1b"), ("chimera split", "dualpipe"),
               ("chimera split", "dualpipev"))


def _split_ratios(by: dict, n: int) -> dict:
    """Throughput of each split schedule over its unsplit self, and of Chimera split over DualPipe."""
    return {f"{a}/{b} N={n}": by[(a, n)]["tokens_per_s"] / by[(b, n)]["tokens_per_s"]
            for a, b in SPLIT_PAIRS if (a, n) in by and (b, n) in by}


def _distopt_ratios(by: dict, n: int) -> dict:
    """Each Chimera row with --use-distributed-optimizer against itself without it (throughput, model
    state per rank), and the optimizer step of Chimera against 1F1B's, both with and both without it."""
    out = {}
    for label in [s for s, k in by if k == n and s.startswith("chimera") and not s.endswith(DISTOPT)]:
        plain, sharded = by[(label, n)], by.get((label + DISTOPT, n))
        if sharded:
            out[f"{label}{DISTOPT}/{label} N={n}"] = sharded["tokens_per_s"] / plain["tokens_per_s"]
            out[f"{label}{DISTOPT}/{label} model state N={n}"] = (max(sharded["model_state_bytes"])
                                                                    / max(plain["model_state_bytes"]))
    for suffix in ("", DISTOPT):
        c, b = by.get(("chimera direct" + suffix, n)), by.get(("1f1b" + suffix, n))
        if c and b:
            out[f"optimizer step chimera direct/1f1b{suffix} N={n}"] = c["optimizer_ms"] / b["optimizer_ms"]
    return out


def write_outputs(rows, comm, cfg, out, name) -> None:
    import matplotlib  # here, not at the top: only the plot needs it (2 s to import), and Agg must precede pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.join(out, "traces"), exist_ok=True)
    for r in rows:
        if "_measured" in r:
            slug = f"{name}_{r['schedule'].replace(' ', '-')}_N{r['N']}"
            with open(os.path.join(out, "traces", slug + ".json"), "w") as f:
                json.dump(perfetto_trace(r["_measured"]), f)
    pick = [r for r in rows if r["N"] == 4 and r["schedule"] in ("1f1b", "chimera direct")]
    for r in pick:
        png_timeline(r["_measured"], os.path.join(out, f"{name}_timeline_{r['schedule'].replace(' ', '-')}_N4.png"))
    labels = sorted({r["schedule"] for r in rows}, key=[r["schedule"] for r in rows].index)
    ns = sorted({r["N"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ys = [next((r["tokens_per_s"] for r in rows if r["schedule"] == label and r["N"] == n), 0) for n in ns]
        ax.bar([k + i * width for k in range(len(ns))], ys, width, label=label)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ns))], [f"N={n}" for n in ns])
    ax.set_ylabel("tokens/s (median iteration)")
    ax.set_title(f"{name}: D=2, 2 CPU ranks, GPT {cfg['model'][1]} layers x {cfg['model'][3]} hidden")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}_throughput.png"), dpi=110)
    plt.close(fig)
    write_profile(rows, comm, cfg, out)
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    doc = {"name": name, "date": str(date.today()), "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores, {socket.gethostname()}", "config": cfg, "comm": comm,
           "ratios": ratios(rows), "results": clean}
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)


def write_profile(rows, comm, cfg, out) -> None:
    """This machine as a planner profile (profiles/cpu-<host>.json), from this run's measurements:
    sustained FLOP/s of a stage's forward (1F1B, N=4), one-way p2p time of one activation, and the
    all-reduce time of one stage's gradients between the two ranks (as bandwidths, latency folded in)."""
    m = dict(zip(cfg["model"][::2], cfg["model"][1::2]))
    shape = ModelShape(int(m["--num-layers"]), int(m["--hidden-size"]), int(m["--num-attention-heads"]),
                       int(m["--seq-length"]), int(m["--vocab-size"]))
    b = int(m["--micro-batch-size"])
    ref = next(r for r in rows if r["schedule"] == "1f1b" and r["N"] == 4)
    flops = (shape.layers // 2) * shape.layer_forward_flops(b) / (ref["costs_ms"]["forward"][0] / 1e3)
    act_bytes = shape.seq * b * shape.hidden * 4
    grad_bytes = 2 * 12 * shape.hidden ** 2 * 4
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    profile = {"name": f"cpu-{socket.gethostname()} (measured {date.today()})",
               "source": f"Measured by python -m benchmarks.quick --quick on {date.today()}: "
                         f"{os.cpu_count()} cores, one thread per rank, gloo over loopback.",
               "flops": flops, "p2p_latency": 0.0, "p2p_bandwidth": act_bytes / (comm["p2p_ms"] / 1e3),
               "allreduce_latency": 0.0, "allreduce_bandwidth": grad_bytes / (comm["allreduce_ms"] / 1e3),
               "memory": mem}
    os.makedirs(os.path.join(ROOT, "profiles"), exist_ok=True)
    with open(os.path.join(ROOT, "profiles", "cpu-this-machine.json"), "w") as f:
        json.dump(profile, f, indent=1)


def table(doc: dict) -> str:
    lines = [f"{'schedule':<26}{'N':>3}{'ms/iter':>9}{'(min-max)':>15}{'pred ms':>9}{'tokens/s':>10}"
             f"{'bubble':>8}{'pred':>7}{'opt ms':>8}"]
    for r in doc["results"]:
        it = r["iteration_ms"]
        bub = f"{r['bubble_measured']:8.1%}" if "bubble_measured" in r else f"{'-':>8}"
        spread = "({:.0f}-{:.0f})".format(it["min"], it["max"])
        lines.append(f"{r['schedule']:<26}{r['N']:>3}{it['median']:9.1f}{spread:>15}"
                     f"{r['predicted_ms']:9.1f}{r['tokens_per_s']:10.0f}{bub}{r['bubble_predicted']:7.1%}"
                     f"{r['optimizer_ms']:8.1f}")
    lines += [f"{k}: {v:.2f}x" for k, v in doc["ratios"].items() if isinstance(v, float)]
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    """The README's results tables, from the JSON."""
    ns = sorted({r["N"] for r in doc["results"]})
    out = ["| N | schedule | ms/iter (min-max) | predicted ms | tokens/s | bubbles measured | predicted "
           "| optimizer step ms | model state per rank (bytes) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        it = r["iteration_ms"]
        measured = f"{r['bubble_measured']:.1%}" if "bubble_measured" in r else "-"
        out.append(f"| {r['N']} | {r['schedule']} | {it['median']:.0f} ({it['min']:.0f}-{it['max']:.0f}) | "
                   f"{r['predicted_ms']:.0f} | {r['tokens_per_s']:.0f} | {measured} | {r['bubble_predicted']:.1%} | "
                   f"{r['optimizer_ms']:.1f} | {max(r['model_state_bytes'])} |")
    out += ["", "| N | chimera direct over our 1f1b | over megatron-core's 1F1B | over GPipe | over data parallelism "
            "| best Chimera over the faster 1F1B (per round) |", "|---|---|---|---|---|---|"]
    for n in ns:
        ratio = [doc["ratios"].get(f"chimera/{b} N={n}") for b in ("1f1b", "megatron-1f1b", "gpipe", "data-parallel")]
        best = doc["ratios"].get(f"best chimera/best 1f1b N={n}")
        rounds = doc["ratios"].get(f"best chimera/best 1f1b N={n} per round", [])
        pair = doc["ratios"].get(f"best chimera/best 1f1b N={n} pair", "")
        best_cell = f"{best:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}; {pair})" if best else "-"
        out.append(f"| {n} | " + " | ".join(f"{x:.2f}x" if x else "-" for x in ratio) + f" | {best_cell} |")
    out += ["", "| N | Chimera variant | with --use-distributed-optimizer: throughput | model state per rank |",
            "|---|---|---|---|"]
    for n in ns:
        for key, value in doc["ratios"].items():
            if key.endswith(f" N={n}") and DISTOPT + "/" in key and "model state" not in key:
                label = key.split(DISTOPT)[0]
                state = doc["ratios"][f"{label}{DISTOPT}/{label} model state N={n}"]
                out.append(f"| {n} | {label} | {value:.2f}x | {state:.2f}x |")
    out += ["", "| N | optimizer step, Chimera direct over 1F1B | both with --use-distributed-optimizer |",
            "|---|---|---|"]
    for n in ns:
        cells = [doc["ratios"].get(f"optimizer step chimera direct/1f1b{s} N={n}") for s in ("", DISTOPT)]
        out.append(f"| {n} | " + " | ".join(f"{x:.2f}x" if x else "-" for x in cells) + " |")
    return "\n".join(out + _split_markdown(doc, ns)) + "\n"


def _split_markdown(doc: dict, ns: list[int]) -> list[str]:
    """The split-backward rows measured against their predictions, and the throughput ratios."""
    out = ["", "| N | schedule | ms/iter measured | predicted | measured / predicted | bubbles measured | predicted |",
           "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if r["schedule"] in {name for pair in SPLIT_PAIRS for name in pair}:
            it = r["iteration_ms"]["median"]
            out.append(f"| {r['N']} | {r['schedule']} | {it:.0f} | {r['predicted_ms']:.0f} | "
                       f"{it / r['predicted_ms']:.2f} | {r['bubble_measured']:.1%} | {r['bubble_predicted']:.1%} |")
    out += ["", "| N | " + " | ".join(f"{a} over {b}" for a, b in SPLIT_PAIRS) + " |",
            "|---|" + "---|" * len(SPLIT_PAIRS)]
    for n in ns:
        cells = [doc["ratios"].get(f"{a}/{b} N={n}") for a, b in SPLIT_PAIRS]
        out.append(f"| {n} | " + " | ".join(f"{x:.2f}x" if x else "-" for x in cells) + " |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quick", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 CPU ranks, D=2, N=2,4,8 (the only mode so far)")
    p.add_argument("--name", default="quick")
    p.add_argument("--only", default="", help="only the cases whose label contains this text, plus 1f1b (the "
                   "baseline other predictions use): a quick look; the README's tables come from full runs")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker({**QUICK, "only": args.only}, args.out, args.name)
        return
    if not args.quick:
        p.error("only --quick exists so far; see benchmarks/results/scale_projection.md "
                "for the cluster-scale projection")
    os.makedirs(args.out, exist_ok=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(port), "-m", "benchmarks.quick", "--worker", "--name", args.name,
                           "--out", args.out, "--only", args.only],
                          env=env, cwd=ROOT)
    if proc.returncode:
        sys.exit(proc.returncode)
    with open(os.path.join(args.out, f"{args.name}.json")) as f:
        doc = json.load(f)
    print(table(doc))
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(markdown(doc))
    print(f"wrote {args.out}/{args.name}.json and plots in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
