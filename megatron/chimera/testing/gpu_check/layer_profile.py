"""One GPT-2 1.3B layer timed on this GPU, and with two GPUs the interconnect, as a planner profile
(profiles/gpu-<device>-<date>.json) that the planner must load and plan with."""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from datetime import date

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from chimera_schedules.tools.planner import ModelShape, Profile, plan
from megatron.chimera.arguments import parse_args
from megatron.chimera.config.job import job_config
from megatron.chimera.config.run_plan import make_run_plan
from megatron.chimera.distributed.ports import free_port
from megatron.chimera.model.chunk import build_chunk, uses_transformer_engine

from .launching import ROOT, Machine, child_env, error_line, launch, result

GPT2_1_3B = dict(layers=64, hidden=1280, heads=20, seq=632, vocab=50257)  # the paper's GPT-2 1.3B, micro-batch 1
INTERCONNECT = ("p2p_latency", "p2p_bandwidth", "allreduce_latency", "allreduce_bandwidth")
PEAK_FLOPS = 2.5e15  # above any GPU's dense bf16 rate: a faster layer means a timing that missed its kernels


def check_layer_profile(m: Machine) -> dict:
    """The layer's times are sane (backward 0.5-5x forward: about 2x when the GPU computes, near 1x when
    launches bound it, as at micro-batch 1 on an H200 without Transformer Engine; below any GPU's peak
    rate). With two or more GPUs the profile is written, with its interconnect measured, and the planner
    plans GPT-2 1.3B on 8 GPUs with it; with one GPU none is written."""
    if m.need(1):
        return result("skipped", m.need(1))

    timing = layer_times()
    rate = ModelShape(**GPT2_1_3B).layer_forward_flops(1) / timing["forward_s"]
    timing["forward_flops_per_s"] = rate
    ratio = timing["backward_s"] / timing["forward_s"]
    insane = [why for why, bad in (
        (f"forward {timing['forward_s'] * 1e3:.3f} ms is {rate / 1e12:.0f} TFLOP/s, above any GPU", rate > PEAK_FLOPS),
        (f"backward/forward = {ratio:.2f}, outside 0.5-5", not 0.5 <= ratio <= 5)) if bad]
    if insane:
        return result("fail", insane[0], layer=timing)
    if m.gpus < 2:
        return result("pass", f"layer forward {timing['forward_s'] * 1e3:.3f} ms ({rate / 1e12:.0f} TFLOP/s); "
                      "no profile written: one GPU cannot measure the interconnect", layer=timing,
                      interconnect="unmeasured")
    interconnect = measure_interconnect(m)
    bad = [k for k in INTERCONNECT if not math.isfinite(interconnect[k]) or interconnect[k] <= 0]
    if bad:
        return result("fail", f"interconnect measurement not finite and positive: {bad}", interconnect=interconnect)
    path = write_profile(timing, interconnect)
    ranked = plan(8, 64, ModelShape(**GPT2_1_3B), Profile.load(path))
    return result("pass", f"wrote {os.path.relpath(path, ROOT)}; the planner's pick for 8 GPUs: {ranked[0].label}",
                  profile=os.path.relpath(path, ROOT), layer=timing, interconnect=interconnect)


def layer_times(repeats: int = 20) -> dict:
    """One GPT-2 1.3B layer in bf16 (Transformer Engine's where installed, as training would build it),
    built by the training program's own build_chunk in this process, on GPU 0."""
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    g = GPT2_1_3B
    args = parse_args(["--num-layers", "1", "--hidden-size", str(g["hidden"]), "--num-attention-heads", str(g["heads"]),
                       "--seq-length", str(g["seq"]), "--max-position-embeddings", str(g["seq"]), "--micro-batch-size",
                       "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "1000", "--bf16",
                       "--hidden-dropout", "0", "--attention-dropout", "0"], world_size=1)
    job = job_config(args)
    chunk = build_chunk(job.model, make_run_plan(job.pipeline, job.parallel), 0, torch.device("cuda"))
    layer, seq = chunk.decoder.layers[0], g["seq"]
    forward, backward = _time_layer(layer, repeats, seq, 1)
    pair = sum(_time_layer(layer, repeats, seq, 2))  # two sequences, whose halves are the one above
    first_half = sum(_time_layer(layer, repeats, seq // 2, 1))  # a sequence's first half (the planner's proxy)
    dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name(), "forward_s": forward, "backward_s": backward, "dtype": "bf16",
            "transformer_engine": uses_transformer_engine(args.transformer_impl, "cuda"),
            "halves_efficiency": min(1.0, pair / (2 * (forward + backward))),
            "sequence_halves_efficiency": min(1.0, (forward + backward) / (2 * first_half))}


def _time_layer(layer, repeats: int, seq: int, batch: int) -> tuple[float, float]:
    """Median forward and backward seconds of one layer on ``batch`` sequences of ``seq`` tokens, timed with
    CUDA events after 5 warm-ups."""
    x = torch.randn(seq, batch, GPT2_1_3B["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fwd, bwd = [], []
    for i in range(repeats + 5):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = layer(x, attention_mask=None)[0]
        mid.record()
        out.backward(torch.ones_like(out))
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            fwd.append(start.elapsed_time(mid) / 1e3)
            bwd.append(mid.elapsed_time(end) / 1e3)
    return statistics.median(fwd), statistics.median(bwd)


def write_profile(timing: dict, interconnect: dict) -> str:
    """The planner's profile fields, every one measured here: with one GPU none is written (an
    interconnect is never invented or borrowed from another machine). Returns the path."""
    name = timing["device"].replace(" ", "-").lower()
    profile = {"name": f"gpu-{name} (measured {date.today()})",
               "source": f"Measured by scripts/gpu_check.py on {date.today()} ({timing['device']}, Transformer Engine: "
                         f"{timing['transformer_engine']}): one GPT-2 1.3B layer's bf16 forward, CUDA events; "
                         "interconnect measured between 2 GPUs (NCCL p2p ping-pong of one activation, all-reduce).",
               "flops": ModelShape(**GPT2_1_3B).layer_forward_flops(1) / timing["forward_s"],
               **{k: interconnect[k] for k in INTERCONNECT},
               # a half's rate against the whole's: two sequences and one; a sequence and its first half
               **{k: timing[k] for k in ("halves_efficiency", "sequence_halves_efficiency")},
               "memory": torch.cuda.get_device_properties(0).total_memory}
    path = os.path.join(ROOT, "profiles", f"gpu-{name}-{date.today()}.json")
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)
    return path


def measure_interconnect(m: Machine) -> dict:
    """This script's --interconnect-worker on 2 GPUs under torchrun; the planner's four numbers."""
    out = os.path.join(m.workdir, "interconnect.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "scripts/gpu_check.py", "--interconnect-worker", out]
    rc, stdout, stderr = launch(cmd, child_env(m), timeout=180)
    if rc != 0:
        raise RuntimeError(f"interconnect measurement ({' '.join(cmd)}): exit code {rc}: {error_line(stdout + stderr)}")
    with open(out) as f:
        return json.load(f)


def interconnect_worker(out: str) -> None:
    """Ranks 0 and 1 on GPUs 0 and 1. p2p: one-way time t(n) = latency + n / bandwidth, fitted from 8
    bytes and one activation (the planner's activation_bytes: sequence x hidden x 2). All-reduce over
    r = 2: the planner's 2 log2(r) alpha + 2 (r-1)/r L / beta = 2 alpha + L / beta, from 8 bytes and 4
    layers' bf16 gradients."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    shape = ModelShape(**GPT2_1_3B)
    activation, gradients = shape.seq * shape.hidden * 2, 4 * shape.params_per_layer * 2
    p2p = {n: _cuda_seconds(n, _ping_pong) / 2 for n in (8, activation)}  # a ping-pong is two transfers
    reduce = {n: _cuda_seconds(n, dist.all_reduce) for n in (8, gradients)}
    if dist.get_rank() == 0:
        numbers = {"p2p_latency": p2p[8], "p2p_bandwidth": (activation - 8) / (p2p[activation] - p2p[8]),
                   "allreduce_latency": reduce[8] / 2,
                   "allreduce_bandwidth": (gradients - 8) / (reduce[gradients] - reduce[8])}
        with open(out, "w") as f:
            json.dump({**numbers, "p2p_seconds": p2p, "allreduce_seconds": reduce}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _ping_pong(x) -> None:
    """Rank 0 sends to rank 1, which sends it back: two one-way transfers."""
    if dist.get_rank() == 0:
        dist.send(x, 1)
        dist.recv(x, 1)
    else:
        dist.recv(x, 0)
        dist.send(x, 0)


def _cuda_seconds(nbytes: int, op, repeats: int = 50) -> float:
    """Seconds of one call of ``op`` on ``nbytes``: CUDA events around ``repeats`` calls after 5
    warm-ups (the first sets NCCL's communicator up)."""
    x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(5):
        op(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        op(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats
