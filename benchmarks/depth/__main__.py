"""Pipeline schedules at real depths on an emulated device, side by side with megatron-core's and
torch.distributed.pipelining's runtimes, each at the layouts a user would run it at.

    python -m benchmarks.depth                          # GPT-2 1.3B, D = 4, 8, 16 into benchmarks/results/depth.json
    python -m benchmarks.depth --stages 8 --out FILE    # one depth
    python -m benchmarks.depth --stages 8 --model llama3-8b --out FILE  # the fair comparison (FAIRNESS)
    python -m benchmarks.depth --stages 8 --model gpt2-1.3b --selection fair --out FILE
    python -m benchmarks.depth --stages 8 --model llama3-8b --selection full  # every runtime, schedule and N
    python -m benchmarks.depth --stages 8 --model deepseek-v3 --a2a-fraction 0.5 --out FILE  # issue 35
    python -m benchmarks.depth --stages 8 --model-flags my_model.flags --out FILE  # a launch script's model

One launch of D gloo processes per depth; every rank holds stage modules that wait their stage's time
(benchmarks/depth/stage.py) instead of computing, with real parameters, activations and messages. It
runs our executor, megatron-core's 1F1B and interleaved schedules and torch.distributed.pipelining's
(``--runtimes``, ``--schedules``) at the ``even``, ``megatron`` and ``balanced`` layouts (``--layouts``),
each against the simulator's prediction at the same costs; with ``--a2a-fraction`` each MoE layer also
waits an all-to-all, and our 1F1B, Chimera direct and split and DualPipe run with overlap on and off.
How stage times, layouts and messages are chosen, what an iteration and its bubble are, how the
prediction prices messages, and what the overlap rows report: docs/notes/depth-benchmark.md.

Writes FILE (rows: model, runtime, schedule, layout_kind, layout, D, N, ms, ms_min, ms_max,
predicted_ms, bubble, predicted_bubble, and more; the ratios and the targets), its tables (.md) and a
plot (.png) beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from chimera_schedules import ConfigError, Op
from chimera_schedules.ir import parts
from chimera_schedules.ir.costs import halves_efficiency_at
from chimera_schedules.registry import VARIANTS
from chimera_schedules.tools.planner import MODELS, Profile
from megatron.chimera.distributed.ports import free_port
from megatron.chimera.model import cpu_compat

from . import auto_row, layouts, models, moe, runtimes, stage
from .costs import a2a_critical_ms, default_profile, message_target_ms, predict, unscaled_forward
from .layouts import KINDS
from .moe import stage_parts
from .report import document, markdown, plot, table
from .runtimes import COMBINED, DTYPE, HIDDEN, MEGATRON, OVERLAP, SEQ, TORCH, without_overlap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEPTHS = (4, 8, 16)
MEMORY_BOUND_DEPTH = 16  # here N = 4D does not fit: 16 ranks of N=64 cases ran out of this machine's 24 GB
RUNTIMES = ("ours", "megatron-core", "torch")
A2A_FRACTIONS = (0.25, 0.5, 1.0)


def default_microbatches(depth: int) -> list[int]:
    """N = D, 2D and 4D; at D=16 only D and 2D (``--microbatches 64`` asks for 4D on a bigger machine)."""
    return [depth, 2 * depth] + ([4 * depth] if depth < MEMORY_BOUND_DEPTH else [])


OURS = ("1f1b", "interleaved v=2", "chimera direct", "chimera doubling", "chimera best", "chimera split",
        "chimera split best", "dualpipe", "dualpipev", "gpipe", "1f1b split",
        "v-min", "v-half", "v-zb", "hanayo", "bitpipe", "bitpipe split")  # the last six: Chimera's successors


# --a2a-fraction: these of our schedules, each with and without overlap, and megatron-core's two
A2A_SCHEDULES = ("1f1b", "chimera direct", "chimera doubling", "chimera split", "chimera split best", "dualpipe",
                 "dualpipev", "v-min", "v-half", "v-zb", "hanayo", "bitpipe")
CONTENTIONS = (0.0, 0.15)  # --a2a-fraction's default --contention: none, and DeepEP's share of an H100's SMs


def _selected(names, args) -> list[str]:
    return [name for name in names if args.schedules is None or name in args.schedules]


def _ours(args) -> list[str]:
    """Our variants to run: the selected ones; with --a2a-fraction each also with overlap, where the
    registry has that variant."""
    if not args.a2a_fraction:
        return _selected(OURS, args)
    return [name for base in _selected(OURS, args) if base in A2A_SCHEDULES
            for name in (base, base + OVERLAP) if name in VARIANTS]


def _references(setup, n: int, args, skipped: list[str]) -> list[tuple]:
    """(runtime, schedule name, contention, the order it runs) for each of our cases and megatron-core's
    at N=n that ``--runtimes`` and ``--schedules`` select; ours are built at the even layout's costs
    (``--order best``, a split backward's W placement and the overlap pass depend on them) and run
    unchanged at every layout; an overlap variant once per ``--contention``."""
    out = []
    if "ours" in args.runtimes:
        for name in _ours(args):
            for contention in args.contention if name.endswith(OVERLAP) else [0.0]:
                try:
                    out.append(("ours", name, contention, runtimes.ours_schedule(setup, name, n, contention)))
                except ConfigError as e:
                    skipped.append(f"ours {name} N={n}: {e}")
                    break
    if "megatron-core" in args.runtimes:
        names = [*runtimes.MEGATRON, runtimes.COMBINED] if args.a2a_fraction else runtimes.MEGATRON
        out += [("megatron-core", name, 0.0, runtimes.megatron_order(setup.depth, n, name))
                for name in _selected(names, args)]
    return out


def plan(setup, args, microbatches: list[int]) -> tuple[list, list[str]]:
    """Our cases and megatron-core's, each with its layout, decided on rank 0 (``--order best``
    searches for a minute at D=8, a layout search takes about a second) and sent to every rank: tuples
    (runtime, schedule name, N, order, layouts.Chosen); and why the sizes rule some out."""
    entries, skipped = [], []
    if dist.get_rank() == 0:
        for n in microbatches:
            for runtime, name, contention, order in _references(setup, n, args, skipped):
                for chosen in layouts.choose(setup, order, args.layouts, skipped, f"{runtime} {name} N={n}"):
                    entries.append((runtime, name, n, contention, order, chosen))
            if "ours" in args.runtimes and _selected([auto_row.AUTO], args):
                entries.append(auto_row.entry(setup, n))
    box = [(entries, skipped)]
    dist.broadcast_object_list(box, 0)
    return box[0]


def build_cases(setup, args, microbatches: list[int]) -> tuple[list, list[str]]:
    """Every case the sizes and the options allow, built on this rank; and why the others were left out."""
    entries, skipped = plan(setup, args, microbatches)
    setup.create_groups([order for runtime, _, _, _, order, _ in entries if runtime == "ours"])
    cases = [runtimes.ours(setup, name, n, order, chosen, contention) if runtime == "ours"
             else runtimes.megatron(setup, name, n, chosen) for runtime, name, n, contention, order, chosen in entries]
    if "torch" in args.runtimes and "even" in args.layouts:
        for n in microbatches:
            for cls in (c for c, (name, _, _) in runtimes.TORCH.items() if _selected([name], args)):
                try:
                    cases.append(runtimes.torch_pipelining(setup, cls, n))
                except ValueError as e:  # torch's own rules, e.g. N below the number of stages
                    skipped.append(f"torch {runtimes.TORCH[cls][0]} N={n}: {str(e).splitlines()[0]}")
    dist.barrier()
    return cases, skipped


def p2p_ms(shape: tuple, dtype) -> float:
    """The time (ms) of one activation between neighbours when every rank sends one at once, as all
    do in a pipeline's steady state: the median over ranks of each rank's median ring shift (receive
    from the rank before, send to the rank after). On this machine the ranks' transfers share its two
    cores, so this is about twice an isolated pair's one-way time at D=8, and what a message costs
    inside every runtime's iteration."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y, times = torch.zeros(shape, dtype=dtype), torch.empty(shape, dtype=dtype), []
    for _ in range(20):
        dist.barrier()
        start = time.perf_counter()
        works = [dist.irecv(y, (rank - 1) % world), dist.isend(x, (rank + 1) % world)]
        for work in works:
            work.wait()
        times.append((time.perf_counter() - start) * 1e3)
    every = [None] * world
    dist.all_gather_object(every, statistics.median(times))
    return statistics.median(every)


def size_messages(setup) -> dict:
    """Sets the messages' rows and their measured cost (docs/notes/depth-benchmark.md, Messages): GPT-2
    1.3B's shape measured, its rows scaled linearly to the profile's share of a stage, the rows chosen
    measured again. Every rank chooses the same rows (the measurements are gathered)."""
    target = message_target_ms(setup.shape, setup.profile, setup.depth, setup.forward_ms)
    full = p2p_ms((SEQ, 1, HIDDEN), DTYPE)
    setup.seq = min(4 * SEQ, max(1, round(SEQ * target / full)))
    setup.p2p_ms = p2p_ms((setup.seq, 1, HIDDEN), DTYPE)
    return {"target_ms": target, "measured_ms": setup.p2p_ms, "shape": [setup.seq, 1, HIDDEN],
            "full_shape_ms": full, "full_shape": [SEQ, 1, HIDDEN]}


def measured_host_ms(setup) -> float:
    """What each part a MoE stage issues adds (moe.host_ms), measured on every rank at once at the middle
    stage's times: the median over ranks, so every rank prices with the same number."""
    dist.barrier()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, moe.host_ms(setup.times(1)[setup.depth // 2]))
    return statistics.median(every)


def executor_host_ms(setup, iters: int = 3) -> float:
    """What each pass our executor runs adds to a plain stage's time beyond the simulator's model (its
    Python around the pass, posting and waiting for the pass's messages, the timed wait's late wake-up;
    CostModel.host), in ms: 1F1B at N = D at the even split, the median of ``iters`` iterations after a
    warm-up (the slowest rank's each), over its prediction without it, the difference divided by what one
    ms per pass adds to that prediction. Every rank gets the same number (the iterations are gathered)."""
    schedule = runtimes.ours_schedule(setup, "1f1b", setup.depth)
    chosen = layouts.choose(setup, schedule, ["even"], [], "1f1b")[0]
    setup.create_groups([schedule])
    case = runtimes.ours(setup, "1f1b", setup.depth, schedule, chosen)
    iteration(case)
    ms = statistics.median(_timed(case, dist.get_world_size())[0] for _ in range(iters))
    case.release()
    model = setup.costs(1, chosen.layout)
    without = predict(schedule, dataclasses.replace(model, host=0.0), True)["predicted_ms"]
    per_ms = predict(schedule, dataclasses.replace(model, host=1.0), True)["predicted_ms"] - without
    return max(0.0, (ms - without) / per_ms)


def iteration(case) -> tuple[float, float, float, float]:
    """One timed iteration on this rank: (seconds from the barrier to return, seconds of stage waits
    (compute), seconds of all-to-all, seconds of it inside the other micro-batch's compute)."""
    stage.SPANS.clear()
    moe.PARTS.clear()
    moe.CONTENTION = case.contention
    dist.barrier()
    start = time.perf_counter()
    case.run()
    end = time.perf_counter()
    return end - start, sum(e - s for _, s, e in stage.SPANS), *moe.a2a_overlap()


def measure(cases, rounds: int, iters: int) -> list[list[tuple]]:
    """Per case, every measured iteration as (ms, bubble, a2a_overlapped_share) over all ranks: ms is
    the slowest rank's, the share None without all-to-all. A
    case runs one untimed iteration first whenever it is new (torch infers shapes and allocates its
    buffers, gloo connects pairs): once, or every round for a case released after each round."""
    world, warm = dist.get_world_size(), [False] * len(cases)
    samples = [[] for _ in cases]
    for r in range(rounds):
        for i, case in enumerate(cases):
            if not warm[i]:
                iteration(case)
            for _ in range(iters):
                samples[i].append(_timed(case, world))
            warm[i] = not case.release()
            gc.collect()
            if dist.get_rank() == 0:
                print(f"[D={world} round {r + 1}/{rounds} {i + 1:2d}/{len(cases)}] {case.runtime:<13} "
                      f"{case.schedule_name:<28} c={case.contention:<4g} {case.chosen.kind:<9} "
                      f"N={case.microbatches:<3} "
                      f"{samples[i][-1][0]:8.1f} ms", flush=True)
    return samples


def _timed(case, world: int) -> tuple[float, float, float | None]:
    every = [None] * world
    dist.all_gather_object(every, iteration(case))
    ms = max(t for t, *_ in every) * 1e3
    a2a = sum(a for *_, a, _ in every)
    share = sum(inside for *_, inside in every) / a2a if a2a else None
    return ms, 1 - sum(b for _, b, *_ in every) * 1e3 / (world * ms), share


def row(setup, case, samples) -> dict:
    """One result row: the measured iterations' median and spread, the simulator's prediction, the
    layout (Megatron-LM's string; the flags that ask for it where it is Megatron-LM's best; the
    planner's memory of its largest worker, which the emulated device does not hold)."""
    ms = [m for m, *_ in samples]
    median = statistics.median(ms)
    bubble = statistics.median(b for _, b, _ in samples)
    chosen = case.chosen
    model = setup.costs(case.schedule.virtual_stages, chosen.layout, case.first_input_in_weight, case.contention)
    if case.runtime != "ours" and not setup.a2a_fraction:  # the host cost per pass was measured on our executor
        model = dataclasses.replace(model, host=0.0)
    pred = predict(case.schedule, model, case.lowered)
    layout = {"layout": str(chosen.layout), "layout_kind": chosen.kind,
              "layout_memory_gib": None if chosen.memory is None else chosen.memory / 2 ** 30,
              "layout_fits": chosen.fits, **({"megatron_flags": chosen.flags} if chosen.kind == "megatron" else {})}
    out = {"model": setup.model, "runtime": case.runtime, "schedule": case.schedule_name, "D": setup.depth,
           "N": case.microbatches, **layout, "ms": median, "ms_min": min(ms), "ms_max": max(ms), "samples_ms": ms,
           **pred, "bubble": bubble, "measured_over_predicted": median / pred["predicted_ms"]}
    if setup.a2a_fraction:
        shares = [a for *_, a in samples if a is not None]
        ops = [a.op for actions in case.schedule.workers for a in actions]
        out.update(overlap=case.overlap, a2a_fraction=setup.a2a_fraction, contention=case.contention,
                   overlapped_actions=ops.count(Op.OVERLAPPED), halved_actions=ops.count(Op.HALVED),
                   a2a_overlapped_share=statistics.median(shares) if shares else 0.0)
    return out


def add_a2a_critical(setup, cases, rows: list[dict]) -> None:
    """Each row's a2a_critical_ms: its control's (the same variant without overlap, same N and layout),
    from the simulator (costs.a2a_critical_ms)."""
    critical = {}
    for case in (c for c in cases if not c.overlap):
        model = setup.costs(case.schedule.virtual_stages, case.chosen.layout)
        critical[(case.schedule_name, case.microbatches, case.chosen.kind)] = a2a_critical_ms(case.schedule, model)
    for case, r in zip(cases, rows):
        r["a2a_critical_ms"] = critical.get((without_overlap(case.schedule_name), case.microbatches,
                                             case.chosen.kind))


def overlap_timeline(setup) -> str:
    """One overlapped F&B action drawn (parts.ascii_timeline): a middle stage of the even split, one
    micro-batch's forward beside another's whole backward; its first two layer pairs, the rest repeat
    them (a part is too short to label at the whole action's scale)."""
    t = setup.times(1)[setup.depth // 2]
    order = parts.interleave(stage_parts(t, "F", t.forward), stage_parts(t, "B", t.input + t.weight))
    return (f"stage {setup.depth // 2} of {setup.depth}: {t.moe_layers} MoE layers, forward {t.forward * 1e3:.1f} ms, "
            f"backward {(t.input + t.weight) * 1e3:.1f} ms, all-to-all {t.a2a * 1e3:.1f} ms per pass, overlapped "
            f"{parts.span(order) * 1e3:.1f} ms; its first two layer pairs\n" + parts.ascii_timeline(order[:16], 110))


def worker(args) -> None:
    dist.init_process_group("gloo")
    cpu_compat.apply()  # megatron-core's schedules allocate their p2p buffers on "the" CUDA device
    from megatron.core import parallel_state  # here: after megatron.chimera, which silences its warnings

    d = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, d)
    profile = Profile.load(args.profile)
    setup = runtimes.Setup(d, forward_ms(args, profile, d), args.name, profile, args.shape,
                           a2a_fraction=args.a2a_fraction or 0.0, micro_batch_size=args.micro_batch_size,
                           halves_efficiency=halves_efficiency(args, profile))
    moe.HALVES_EFFICIENCY = setup.halves_efficiency
    message = size_messages(setup)
    setup.host_ms = measured_host_ms(setup) if setup.a2a_fraction else executor_host_ms(setup)
    microbatches = args.microbatches or default_microbatches(d)
    cases, skipped = build_cases(setup, args, microbatches)
    samples = measure(cases, args.rounds, args.iters)
    if dist.get_rank() == 0:
        rows = [row(setup, c, s) for c, s in zip(cases, samples)]
        doc = {"D": d, "model": args.name, "profile": {"name": profile.name, "path": os.path.relpath(args.profile,
               ROOT)}, "forward_ms": setup.forward_ms, "p2p_ms": setup.p2p_ms, "host_ms": setup.host_ms,
               "message": message, "layouts": args.layouts, "rounds": args.rounds, "iters": args.iters,
               "skipped": skipped, "rows": rows}
        if setup.a2a_fraction:
            add_a2a_critical(setup, cases, rows)
            doc.update(a2a_fraction=setup.a2a_fraction, overlap_timeline=overlap_timeline(setup),
                       micro_batch_size=setup.micro_batch_size, halves_along=halves_along(setup.micro_batch_size),
                       halves_efficiency=setup.halves_efficiency)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def halves_efficiency(args, profile) -> float:
    """--halves-efficiency, else the profile's for the split the micro-batch size takes (1.0 unmeasured)."""
    if args.halves_efficiency is not None:
        return args.halves_efficiency
    return halves_efficiency_at(args.micro_batch_size, profile.halves_efficiency, profile.sequence_halves_efficiency)


def halves_along(micro_batch_size: int) -> str:
    """Which split a halved action takes at this size (the trainer's, config/schedule_request.halves_split)."""
    return "batch" if micro_batch_size % 2 == 0 else "sequence"


def forward_ms(args, profile, depth: int) -> float:
    """The clock: --forward-ms, else 20 ms for the full selection (the scale of the results before
    models), else the profile's own median forward at this depth. At the profile's own time a message's
    target is its own time too (Llama 3 8B at D=8 on the H100 profile: a 51 ms stage, a 1.3 ms message),
    which gloo here can meet; at 20 ms the target falls further below gloo's fixed cost per message."""
    if args.forward_ms:
        return args.forward_ms
    own = args.selection != "full"
    return round(unscaled_forward(args.shape, profile, depth) * 1e3, 1) if own else 20.0


def launch(depth: int, args, out: str) -> dict:
    """One torchrun of ``depth`` processes; its JSON."""
    port = str(free_port())
    microbatches = args.microbatches or {"fair": [depth, 2 * depth], "a2a": [2 * depth]}.get(args.selection)
    extra = ["--microbatches", *map(str, microbatches)] if microbatches else []
    extra += ["--schedules", *args.schedules] if args.schedules else []
    extra += ["--forward-ms", str(args.forward_ms)] if args.forward_ms else []
    extra += ["--model-flags", os.path.abspath(args.model_flags)] if args.model_flags else ["--model", args.model]
    extra += (["--a2a-fraction", str(args.a2a_fraction), "--contention", *map(str, args.contention),
               "--micro-batch-size", str(args.micro_batch_size)]
              if args.a2a_fraction else ["--selection", args.selection])
    extra += ["--halves-efficiency", str(args.halves_efficiency)] if args.halves_efficiency is not None else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(depth), "--master_port", port,
           "-m", "benchmarks.depth", "--worker", "--out", out,
           "--rounds", str(args.rounds), "--iters", str(args.iters), "--profile", args.profile,
           "--layouts", *args.layouts, "--runtimes", *args.runtimes, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode:
        sys.exit(proc.returncode)
    with open(out) as f:
        return json.load(f)


# --selection fair: our Chimera variants without split backward against our and megatron-core's 1F1B,
# each at its three layouts, at N = D and 2D
FAIRNESS = {"runtimes": ["ours", "megatron-core"], "schedules": ["1f1b", "chimera direct", "chimera doubling",
                                                                  "chimera best", auto_row.AUTO], "rounds": 2}
# --a2a-fraction: our schedules with overlap and without, megatron-core's, at the even layout and N = 2D (launch)
A2A = {"runtimes": ["ours", "megatron-core"], "schedules": [*A2A_SCHEDULES, "interleaved v=2", COMBINED, auto_row.AUTO],
       "rounds": 2,
       "layouts": ["even"], "contention": list(CONTENTIONS)}
FULL = {"runtimes": list(RUNTIMES), "schedules": None, "rounds": 3}


def _selection(args) -> None:
    """Fill in what was not given: A2A with --a2a-fraction, else FAIRNESS, or everything (GPT-2's
    historical run); every layout kind but with --a2a-fraction."""
    if args.a2a_fraction:
        args.selection = "a2a"
    args.selection = args.selection or ("full" if args.name == "gpt2-1.3b" else "fair")
    defaults = {"fair": FAIRNESS, "a2a": A2A, "full": FULL}[args.selection]
    for option, value in defaults.items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    args.layouts = args.layouts or list(KINDS)


def _overlap_options(p: argparse.ArgumentParser) -> None:
    """The options that shape --a2a-fraction's overlapped actions."""
    p.add_argument("--contention", type=float, nargs="+",
                   help="with --a2a-fraction: compute's slowdown while an all-to-all runs beside it, one run of each "
                        f"overlap case per value (default {' '.join(map(str, CONTENTIONS))})")
    p.add_argument("--micro-batch-size", type=int, default=1,
                   help="with --a2a-fraction: the micro-batch size the stage times are for; a halved action runs the "
                        "two halves of each sequence at an odd size, of the batch at an even one (default 1: the "
                        "models' stage times are per sequence, and every time scales with it alike)")
    p.add_argument("--halves-efficiency", type=float,
                   help="with --a2a-fraction: a halved action's compute rate for its size (default: the profile's "
                        "for the split --micro-batch-size takes, 1.0 where it has none)")


def arguments() -> argparse.Namespace:
    """The options; ``--profile`` defaults to the model's (costs.PROFILES) and must exist."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.depth", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", "--depth", dest="depths", type=int, nargs="+", default=list(DEPTHS),
                   help="pipeline depths D (one launch each)")
    p.add_argument("--microbatches", type=int, nargs="+", help="N values (default: D, 2D and 4D; D and 2D at D=16)")
    p.add_argument("--model", choices=list(MODELS), default="gpt2-1.3b", help="whose stage times the stages wait")
    p.add_argument("--model-flags", metavar="FILE",
                   help="instead of --model: a file of Megatron-LM model flags as a launch script has them (the "
                        "trainer's parser reads it); profiles/h100-datasheet.json unless --profile")
    p.add_argument("--profile", help="hardware profile JSON (default: Piz Daint's P100 for gpt2-1.3b, "
                   "profiles/h100-datasheet.json for the others)")
    p.add_argument("--layouts", nargs="+", choices=KINDS, help="layout kinds to run at (default: all; even with "
                   "--a2a-fraction)")
    p.add_argument("--runtimes", nargs="+", choices=RUNTIMES, help=f"default: {', '.join(RUNTIMES)}")
    names = list(dict.fromkeys([*OURS, auto_row.AUTO, *MEGATRON, COMBINED, *(name for name, _, _ in TORCH.values())]))
    p.add_argument("--schedules", nargs="+", choices=names, metavar="NAME",
                   help=f"schedules to run, in whichever runtimes have them (default: all of {', '.join(names)})")
    p.add_argument("--forward-ms", type=float,
                   help="the even split's median 1F1B stage forward (default: 20 for gpt2-1.3b, the paper's scale; "
                        "the profile's own time for the others, so that compute and messages are the profile's)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--selection", choices=("fair", "full"),
                   help="fair: our Chimera variants and 1F1B against megatron-core's 1F1B at N = D and 2D, 2 rounds, "
                        "at the profile's own stage time (the default for llama3-8b and deepseek-v3: about 6 and 12 "
                        "minutes at D=8); full: every runtime and schedule at N = D, 2D and 4D, 3 rounds, at 20 ms "
                        "(the default for gpt2-1.3b, the results before models)")
    p.add_argument("--a2a-fraction", type=float, choices=A2A_FRACTIONS,
                   help="MoE layers spend this fraction of their forward compute in all-to-alls; runs our 1f1b, "
                        "chimera direct, doubling and split, dualpipe and dualpipev with overlap on and off, and "
                        "megatron-core's 1f1b and interleaved, at N = 2D, the even layout, 2 rounds (a model with "
                        "experts: deepseek-v3)")
    _overlap_options(p)
    p.add_argument("--iters", type=int, default=1, help="measured iterations per case per round")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "depth.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.name, args.shape = models.name_of(args.model, args.model_flags), models.shape_of(args.model, args.model_flags)
    if args.a2a_fraction and (args.selection or args.shape.experts is None):
        p.error("--a2a-fraction: a model with experts (deepseek-v3), without --selection")
    if args.a2a_fraction and not set(args.runtimes or ["ours"]) <= {"ours", "megatron-core"}:
        p.error("--a2a-fraction runs our executor and megatron-core's schedules")
    if args.contention and not args.a2a_fraction:
        p.error("--contention: with --a2a-fraction only")
    if args.halves_efficiency is not None and not (args.a2a_fraction and 0 < args.halves_efficiency <= 1):
        p.error("--halves-efficiency: with --a2a-fraction only, in (0, 1]")
    if args.micro_batch_size < 1:
        p.error("--micro-batch-size: at least 1")
    _selection(args)
    args.profile = os.path.abspath(args.profile or (os.path.join(ROOT, "profiles", models.FLAGS_PROFILE)
                                                    if args.model_flags else default_profile(args.model)))
    if not os.path.exists(args.profile):
        p.error(f"--profile {args.profile}: no such file")
    return args


def main() -> None:
    args = arguments()
    if args.worker:
        worker(args)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    start = time.time()
    per_depth = [launch(d, args, f"{args.out}.D{d}.part") for d in args.depths]
    doc = document(per_depth, " ".join(["python", "-m", "benchmarks.depth", *sys.argv[1:]]))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for d in args.depths:
        os.remove(f"{args.out}.D{d}.part")
    stem = os.path.splitext(args.out)[0]
    plot(doc, stem + ".png")
    with open(stem + ".md", "w") as f:
        f.write(markdown(doc))
    print(table(doc))
    print(f"wrote {args.out}, {stem}.md and {stem}.png in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
