"""Pipeline schedules at real depths on an emulated device, side by side with megatron-core's and
torch.distributed.pipelining's runtimes.

    python -m benchmarks.depth                          # D = 4, 8, 16 into benchmarks/results/depth.json
    python -m benchmarks.depth --stages 8 --out FILE    # one depth

One launch of D gloo processes per depth. Every rank holds stage modules whose forward, input-gradient
and weight-gradient passes wait their stage's time (benchmarks/depth/stage.py) instead of computing, with
real parameters and real activations of GPT-2 1.3B's shape in bf16, so the schedules, the runtimes
and the messages are real while the ranks no longer compete for this machine's two cores, as GPU
ranks do not. The times are the planner's for GPT-2 1.3B on the Piz Daint profile, scaled so a
forward is ``--forward-ms`` (benchmarks/depth/costs.py).

The same modules run under our executor (every registry schedule the sizes allow), megatron-core's
1F1B and interleaved schedules, and torch.distributed.pipelining's Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV,
at N = D, 2D and 4D (D and 2D at D=16, where 4D does not fit in this machine's memory). Each case is
built once and warmed up once; then every round runs every case,
so that a slow spell of the machine hits all alike. An iteration is one forward and backward of N
micro-batches from a barrier to the last rank's return (no optimizer step: the peers' runtimes have
none); its bubble is the share of the D ranks' time not spent in a stage's wait.

The prediction is the simulator's makespan at the same costs, each message priced at what an
activation takes between neighbours while every rank sends one (measured at the start of each
launch): our executor's lowered lists under gloo's rules, the peers' compute orders (torch's own
``pipeline_order``; megatron-core's are our 1f1b's and interleaved's) with each message a fixed
delay.

Writes FILE (rows: runtime, schedule, D, N, ms, ms_min, ms_max, predicted_ms, bubble,
predicted_bubble, and more; the ratios and the targets), its tables (.md) and a plot (.png) beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from megatron.chimera.distributed.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEPTHS = (4, 8, 16)
MEMORY_BOUND_DEPTH = 16  # here N = 4D does not fit: 16 ranks of N=64 cases ran out of this machine's 24 GB


def default_microbatches(depth: int) -> list[int]:
    """N = D, 2D and 4D; at D=16 only D and 2D (``--microbatches 64`` asks for 4D on a bigger machine)."""
    return [depth, 2 * depth] + ([4 * depth] if depth < MEMORY_BOUND_DEPTH else [])
OURS = ("1f1b", "interleaved v=2", "chimera direct", "chimera doubling", "chimera best", "chimera split",
        "dualpipe", "dualpipev", "gpipe", "1f1b split")


def our_schedules(setup, microbatches: list[int]) -> tuple[list, list[str]]:
    """Our cases' schedules, generated on rank 0 (``--order best`` searches for a minute at D=8) and
    sent to every rank; and why the sizes rule some out."""
    import torch.distributed as dist

    from chimera_schedules import ConfigError

    from . import runtimes

    built, skipped = [], []
    if dist.get_rank() == 0:
        for n in microbatches:
            for name in OURS:
                try:
                    built.append((name, n, runtimes.ours_schedule(setup, name, n)))
                except ConfigError as e:
                    skipped.append(f"ours {name} N={n}: {e}")
    box = [(built, skipped)]
    dist.broadcast_object_list(box, 0)
    return box[0]


def build_cases(setup, microbatches: list[int]) -> tuple[list, list[str]]:
    """Every case the sizes allow, built on this rank; and why the others were left out."""
    import torch.distributed as dist

    from . import runtimes

    ours, skipped = our_schedules(setup, microbatches)
    setup.create_groups([s for _, _, s in ours])
    cases = [runtimes.ours(setup, name, n, s) for name, n, s in ours]
    for n in microbatches:
        cases += [runtimes.megatron(setup, name, n) for name in runtimes.MEGATRON]
        for cls in runtimes.TORCH:
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
    import torch
    import torch.distributed as dist

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


def iteration(case) -> tuple[float, float]:
    """One timed iteration on this rank: (seconds from the barrier to return, seconds of stage waits)."""
    import torch.distributed as dist

    from . import stage

    stage.SPANS.clear()
    dist.barrier()
    start = time.perf_counter()
    case.run()
    end = time.perf_counter()
    return end - start, sum(e - s for _, s, e in stage.SPANS)


def measure(cases, rounds: int, iters: int) -> list[list[tuple]]:
    """Per case, every measured iteration as (ms, bubble) over all ranks: ms is the slowest rank's. A
    case runs one untimed iteration first whenever it is new (torch infers shapes and allocates its
    buffers, gloo connects pairs): once, or every round for a case released after each round."""
    import gc

    import torch.distributed as dist

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
                      f"{case.schedule_name:<28} N={case.microbatches:<3} {samples[i][-1][0]:8.1f} ms", flush=True)
    return samples


def _timed(case, world: int) -> tuple[float, float]:
    import torch.distributed as dist

    every = [None] * world
    dist.all_gather_object(every, iteration(case))
    ms = max(t for t, _ in every) * 1e3
    return ms, 1 - sum(b for _, b in every) * 1e3 / (world * ms)


def row(setup, case, samples) -> dict:
    """One result row: the measured iterations' median and spread, the simulator's prediction."""
    from .costs import predict

    ms = [m for m, _ in samples]
    median = statistics.median(ms)
    bubble = statistics.median(b for _, b in samples)
    model = setup.costs(case.schedule.virtual_stages, case.first_input_in_weight)
    pred = predict(case.schedule, model, case.lowered)
    return {"runtime": case.runtime, "schedule": case.schedule_name, "D": setup.depth, "N": case.microbatches,
            "ms": median, "ms_min": min(ms), "ms_max": max(ms), "samples_ms": ms, **pred, "bubble": bubble,
            "measured_over_predicted": median / pred["predicted_ms"]}


def worker(args) -> None:
    import torch.distributed as dist

    from megatron.chimera.model import cpu_compat

    from . import runtimes

    dist.init_process_group("gloo")
    cpu_compat.apply()  # megatron-core's schedules allocate their p2p buffers on "the" CUDA device
    from megatron.core import parallel_state

    d = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, d)
    setup = runtimes.Setup(d, args.forward_ms)
    setup.p2p_ms = p2p_ms((runtimes.SEQ, 1, runtimes.HIDDEN), runtimes.DTYPE)
    microbatches = args.microbatches or default_microbatches(d)
    cases, skipped = build_cases(setup, microbatches)
    samples = measure(cases, args.rounds, args.iters)
    if dist.get_rank() == 0:
        rows = [row(setup, c, s) for c, s in zip(cases, samples)]
        doc = {"D": d, "forward_ms": args.forward_ms, "p2p_ms": setup.p2p_ms, "rounds": args.rounds,
               "iters": args.iters, "skipped": skipped, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def launch(depth: int, args, out: str) -> dict:
    """One torchrun of ``depth`` processes; its JSON."""
    port = str(free_port())
    extra = ["--microbatches", *map(str, args.microbatches)] if args.microbatches else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(depth), "--master_port", port,
           "-m", "benchmarks.depth", "--worker", "--out", out, "--forward-ms", str(args.forward_ms),
           "--rounds", str(args.rounds), "--iters", str(args.iters), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode:
        sys.exit(proc.returncode)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    from .report import document, markdown, plot, table

    p = argparse.ArgumentParser(prog="python -m benchmarks.depth", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", "--depth", dest="depths", type=int, nargs="+", default=list(DEPTHS),
                   help="pipeline depths D (one launch each)")
    p.add_argument("--microbatches", type=int, nargs="+", help="N values (default: D, 2D and 4D; D and 2D at D=16)")
    p.add_argument("--forward-ms", type=float, default=20.0, help="a 1F1B stage's median forward")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=1, help="measured iterations per case per round")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "depth.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
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
