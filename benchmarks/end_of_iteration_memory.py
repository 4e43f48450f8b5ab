"""Memory at the end of an iteration: the bytes the optimizer phase allocates above the model state.

    python -m benchmarks.end_of_iteration_memory              # vocabulary 131072, hidden 1024: about a minute
    python -m benchmarks.end_of_iteration_memory --vocab 32768 --hidden 512 --out FILE

One CPU process holds Chimera's first worker of a GPT with a tied word embedding (both its ends), fills
its gradients and runs the optimizer phase as the trainer does (grad sync ``finish``, gradient norm,
clipping, AdamW's step), each phase's peak being the most bytes torch's CPU allocator held above what
was alive when it began. It measures the code at commit ``BEFORE`` against the working tree's, on the
default path and with --use-distributed-optimizer. What the worker holds, how a peak is measured and
what changed since ``BEFORE``: docs/notes/end-of-iteration-memory.md.

Writes benchmarks/results/end_of_iteration_memory.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import types
from datetime import date
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from megatron.chimera.distributed.process_groups import Runtime
from megatron.chimera.model.parameter_names import TIED_NAME
from megatron.chimera.optim import distributed_optimizer, gradients

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = "e0da1a69e23077943c8fa9f07cb86debb0574c32"  # the last commit with the fp64 norm and stacked tied sum
MIB = 2.0 ** 20


def module_at(commit: str, name: str):
    """megatron/chimera/optim/<name>.py as it was at ``commit``, a module of the same package."""
    path = f"megatron/chimera/optim/{name}.py"
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType(f"megatron.chimera.optim._{name}_at_{commit[:7]}")
    module.__package__ = "megatron.chimera.optim"
    exec(compile(source, f"{commit[:7]}:{path}", "exec"), module.__dict__)
    return module


def peak_mib(fn) -> float:
    """The most bytes ``fn`` held at once above what was alive when it began (torch's CPU allocator)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = top = 0
    for _, nbytes in events:
        live += nbytes
        top = max(top, live)
    return top / MIB


def _param(shape, name: str, tp: bool = True) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(shape).normal_(0, 0.02))
    p.global_name, p.tensor_model_parallel = name, tp  # tp: split over TP ranks, counted on every one
    return p


def _chunk(stage: int, params: list[torch.nn.Parameter]) -> torch.nn.Module:
    chunk = torch.nn.Module()
    for i, p in enumerate(params):
        chunk.register_parameter(f"p{i}", p)
    chunk.stage, chunk.config = stage, SimpleNamespace(gradient_accumulation_fusion=False)
    return chunk


def edge_worker(vocab: int, hidden: int) -> dict:
    """Chimera's first worker at D=2: (pipeline 0, stage 0) and (pipeline 1, stage 1), both ends of the
    tied word embedding; a layer is its 12 h^2 weights (attention and a 4h MLP) and two norms."""
    def layer(n):
        return [_param((3 * hidden, hidden), f"l{n}.qkv"), _param((hidden, hidden), f"l{n}.proj"),
                _param((4 * hidden, hidden), f"l{n}.fc1"), _param((hidden, 4 * hidden), f"l{n}.fc2"),
                _param((hidden,), f"l{n}.norm1", tp=False), _param((hidden,), f"l{n}.norm2", tp=False)]

    first = [_param((vocab, hidden), TIED_NAME)] + layer(0)
    last = layer(1) + [_param((hidden,), "final_norm", tp=False), _param((vocab, hidden), TIED_NAME)]
    return {(0, 0): _chunk(0, first), (1, 1): _chunk(1, last)}


def runtime(dp: int = 1):
    world = dist.group.WORLD
    return Runtime(device=torch.device("cpu"), backend="gloo", rank=0, world=1, tp=1, pp=2, dp=dp, tp_rank=0,
                   dp_rank=0, worker=0, pipelines=2,
                   stage_groups={0: world, 1: world}, embedding_group=world, embedding_stages=(0, 1))


def _adamw(params) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:  # the trainer's _allocate_state: the moments exist before the first step
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    return optimizer


@torch.no_grad()
def _fill(grads) -> None:
    generator = torch.Generator().manual_seed(0)
    for g in grads:
        g.copy_(torch.randn(g.shape, generator=generator))


def replica_path(gradients, chunks: dict, rt) -> dict:
    """The default path: ReplicaGradSync's finish, then global_grad_norm, clip_ and AdamW."""
    by_chunk = {key: list(c.parameters()) for key, c in chunks.items()}  # fp32: the main parameters
    sync = gradients.ReplicaGradSync(by_chunk, rt)
    for p in sync.shared:
        p.grad = torch.zeros_like(p)
    params = [p for ps in by_chunk.values() for p in ps]
    _fill([p.grad for p in params])
    optimizer = _adamw(params)
    norm = []
    phases = {"grad sync finish": sync.finish,
              "gradient norm": lambda: norm.append(gradients.global_grad_norm(by_chunk, rt, True)),
              "clip": lambda: gradients.clip_(by_chunk, 1.0, norm[0]),
              "AdamW step": optimizer.step}
    return _measure(phases, norm)


def sharded_path(distributed_optimizer, chunks: dict, rt) -> dict:
    """--use-distributed-optimizer: ShardedMainParams's finish, grad_norm, clip and AdamW."""
    main = distributed_optimizer.ShardedMainParams(chunks, rt, True)
    _fill([b.grad for b in main.buckets])
    optimizer = _adamw(main.all())
    norm = []
    phases = {"grad sync finish": main.finish, "gradient norm": lambda: norm.append(main.grad_norm(rt, True)),
              "clip": lambda: main.clip(1.0, norm[0]), "AdamW step": optimizer.step}
    return _measure(phases, norm)


def _measure(phases: dict, norm: list) -> dict:
    peaks = {name: round(peak_mib(fn), 1) for name, fn in phases.items()}
    return {"peak_mib": peaks, "optimizer_phase_peak_mib": max(peaks.values()), "grad_norm": norm[0]}


def measure(vocab: int, hidden: int) -> dict:
    """Each path with the code at BEFORE and with ours, each on a fresh edge worker."""
    paths = (("default (ReplicaGradSync)", replica_path, gradients),
             ("--use-distributed-optimizer (ShardedMainParams)", sharded_path, distributed_optimizer))
    rows = []
    for path, run, ours in paths:
        for label, module in ((f"before ({BEFORE[:7]})", module_at(BEFORE, ours.__name__.rsplit(".", 1)[1])),
                              ("after", ours)):
            chunks = edge_worker(vocab, hidden)
            state = sum(p.numel() * 4 * 4 for c in chunks.values() for p in c.parameters())  # w, grad, 2 moments
            rows.append({"path": path, "code": label, "model_state_mib": round(state / MIB, 1),
                         **run(module, chunks, runtime())})
            del chunks
    return {"rows": rows}


def markdown(doc: dict) -> str:
    cfg = doc["config"]
    phases = list(doc["rows"][0]["peak_mib"])
    out = [f"# Memory at the end of an iteration ({doc['date']}, {doc['machine']})", "",
           f"`{doc['command']}`: Chimera's edge worker (both ends of a tied {cfg['vocab']} x {cfg['hidden']} "
           "fp32 word embedding, two layers), peak MiB allocated above the model state in each phase of the "
           "optimizer step (torch's CPU allocator, through torch.profiler).", "",
           "| path | code | model state | " + " | ".join(phases) + " | norm |",
           "|---|---|---:|" + "---:|" * len(phases) + "---:|"]
    for r in doc["rows"]:
        out.append(f"| {r['path']} | {r['code']} | {r['model_state_mib']:.0f} | "
                   + " | ".join(f"{r['peak_mib'][p]:.1f}" for p in phases) + f" | {r['grad_norm']:.9g} |")
    out += ["", f"before: commit {doc['before']}. The distributed optimizer's finish is gloo's reduce-scatter "
            "copying its input (the tied embedding's bucket), the same in both (NCCL reduces in place); AdamW's "
            "step is torch's for-loop AdamW, unchanged. The norms agree within fp32 rounding."]
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.end_of_iteration_memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "end_of_iteration_memory.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state  # here: after megatron.chimera, which silences its warnings

    parallel_state.initialize_model_parallel()
    command = "python -m benchmarks.end_of_iteration_memory" + (
        "" if (args.vocab, args.hidden) == (131072, 1024) else f" --vocab {args.vocab} --hidden {args.hidden}")
    doc = {"command": command, "date": date.today().isoformat(), "machine": f"{platform.machine()}, CPU",
           "torch": torch.__version__, "config": {"vocab": args.vocab, "hidden": args.hidden}, "before": BEFORE,
           **measure(args.vocab, args.hidden)}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(markdown(doc))
    print(markdown(doc))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
