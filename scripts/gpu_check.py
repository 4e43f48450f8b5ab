"""On a machine with a GPU, in one command:

    python scripts/gpu_check.py

1. times the forward and backward of one GPT-2 1.3B layer (hidden 1280, 20 heads, sequence 632,
   micro-batch 1; Transformer Engine's layer spec when installed) and writes a planner profile,
   profiles/gpu-<device>-<date>.json (compute measured; interconnect numbers copied from
   profiles/piz-daint-p100.json, since one GPU has no peer to measure against);
2. trains a small GPT for a few iterations with Chimera on 2 ranks that share this one GPU (NCCL
   refuses that, so p2p and collectives go over gloo through host memory: --p2p-host-staging) and
   with one process on the same GPU, and checks that the losses match.
Writes benchmarks/gpu_check.json.
"""
import json
import os
import re
import socket
import statistics
import subprocess
import sys
from datetime import date

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def layer_times(repeats: int = 20) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron.chimera.config.arguments import parse_args
    from megatron.chimera.config.run_plan import make_run_plan
    from megatron.chimera.model.chunk import build_chunk

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    args = parse_args(["--num-layers", "1", "--hidden-size", "1280", "--num-attention-heads", "20", "--seq-length", "632",
                       "--max-position-embeddings", "632", "--micro-batch-size", "1", "--global-batch-size", "1",
                       "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "1000",
                       "--pipeline-model-parallel-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0"],
                      world_size=1)
    device = torch.device("cuda")
    chunk = build_chunk(args, make_run_plan(args), 0, device)
    forward, backward = _time_layer(chunk.decoder.layers[0], repeats)
    path = _write_profile(forward)
    dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name(), "forward_s": forward, "backward_s": backward,
            "transformer_engine": _te(), "profile": path}


def _time_layer(layer, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of one layer, timed with CUDA events after 5 warm-ups."""
    import torch

    x = torch.randn(632, 1, 1280, device="cuda", requires_grad=True)
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


def _write_profile(forward: float) -> str:
    """A planner profile with this GPU's measured compute; returns its path."""
    import torch

    from chimera_schedules.tools.planner import ModelShape

    shape = ModelShape(64, 1280, 20, 632, 50257)
    name = torch.cuda.get_device_name().replace(" ", "-").lower()
    with open(os.path.join(ROOT, "profiles", "piz-daint-p100.json")) as f:
        network = json.load(f)
    profile = {"name": f"gpu-{name} (measured {date.today()})",
               "source": f"Compute measured by scripts/gpu_check.py on {date.today()} ({torch.cuda.get_device_name()}, "
                         f"Transformer Engine: {_te()}); interconnect copied from profiles/piz-daint-p100.json.",
               "flops": shape.layer_forward_flops(1) / forward,
               "p2p_latency": network["p2p_latency"], "p2p_bandwidth": network["p2p_bandwidth"],
               "allreduce_latency": network["allreduce_latency"], "allreduce_bandwidth": network["allreduce_bandwidth"],
               "memory": torch.cuda.get_device_properties(0).total_memory}
    path = os.path.join(ROOT, "profiles", f"gpu-{name}-{date.today()}.json")
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)
    return path


def _te() -> bool:
    try:
        import transformer_engine  # noqa: F401

        return True
    except ImportError:
        return False


def chimera_on_one_gpu() -> dict:
    common = ["pretrain_gpt.py", "--mock-data", "--vocab-size", "128", "--num-layers", "4", "--hidden-size", "64",
              "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
              "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--disable-bias-linear"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {
        "one process": [sys.executable, *common],
        "chimera D=2, 2 ranks on one GPU": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                            *common, "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                            "chimera", "--p2p-host-staging"],
    }
    losses = {}
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
        losses[name] = [float(x) for x in re.findall(r"lm loss: (\S+) \|", proc.stdout)]
    ref, chimera = losses.values()
    worst = max(abs(a - b) / abs(b) for a, b in zip(chimera, ref))
    return {"losses": losses, "max_relative_difference": worst, "match": worst <= 1e-5}


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: no CUDA device here; the planner uses profiles/piz-daint-p100.json instead")
    result = {"date": str(date.today()), "layer": layer_times(), "chimera_on_one_gpu": chimera_on_one_gpu()}
    os.makedirs(os.path.join(ROOT, "benchmarks"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if not result["chimera_on_one_gpu"]["match"]:
        raise SystemExit("Chimera on the GPU does not match the one-process run")


if __name__ == "__main__":
    main()
