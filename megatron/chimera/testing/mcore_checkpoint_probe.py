"""Megatron-LM's side of the checkpoint tests: a plain GPTModel (no pipeline, one process) saved and
loaded by Megatron-LM's own ``save_checkpoint`` and ``load_checkpoint`` (megatron.training.checkpointing,
from the megatron-core wheel), as a Megatron-LM user's run does.

    python -m megatron.chimera.testing.mcore_checkpoint_probe save DIR -- FLAGS
        # DIR/torch_dist: Megatron-LM's save_checkpoint (torch_dist, iteration 1); DIR/torch: its legacy files
    python -m megatron.chimera.testing.mcore_checkpoint_probe load DIR -- FLAGS
        # Megatron-LM's load_checkpoint of DIR (a --save directory; --probe-step N picks iteration N)

Each prints ``loss BATCH VALUE``: the LM loss of training batch BATCH (``--probe-batch``, default 0)
as pretrain_gpt.py's data gives it, with the saved or loaded weights. FLAGS are pretrain_gpt.py's.

Megatron-LM's checkpoint functions run on the CPU with two answers only CUDA gives them: the CUDA RNG
state its save stores (empty: there is no CUDA generator; loading skips RNG states, --no-load-rng) and the
one ``device='cuda'`` tensor its load all-reduces the iteration number in (made on the CPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.training import checkpointing
from megatron.training.global_vars import set_args

from megatron.chimera import job_config, make_run_plan, parse_args
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.data.datasets import MicrobatchSource, build_datasets, dataset_sizes
from megatron.chimera.data.tokenizer import build_tokenizer
from megatron.chimera.distributed.process_groups import init_distributed
from megatron.chimera.model.chunk import transformer_config


def gpt_model(args):
    """A GPTModel as megatron-core builds and initialises it (not our chunk builder)."""
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(777)
    model_parallel_cuda_manual_seed(777)
    return GPTModel(transformer_config(ModelSpec.from_args(args), args.num_layers),
                    get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type)


@torch.no_grad()
def batch_loss(model, args, index: int) -> float:
    job = job_config(args)
    data, plan = job.data, make_run_plan(job.pipeline, job.parallel)
    train, _ = build_datasets(data, build_tokenizer(data.tokenizer, args), *dataset_sizes(data))
    source = MicrobatchSource(train, data, plan, dp_rank=0, pinned=False, exit_signal=None)
    steps = source.global_batch(index)
    total = count = 0.0
    model.eval()
    for mb in range(plan.microbatches):
        b = source.microbatch(steps, mb)
        losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        total += float((losses.double() * b["loss_mask"]).sum())
        count += float(b["loss_mask"].sum())
    return total / count


def write_legacy(model, args, folder: str) -> None:
    """Megatron-LM's legacy layout for PP=2 (``torch.save`` per rank, as Megatron-LM wrote it): per
    stage, its layers numbered from 0."""
    half = args.num_layers // 2
    state = model.state_dict()
    for stage in range(2):
        own = {}
        for name, tensor in state.items():
            parts = name.split(".")
            if name.startswith("decoder.layers."):
                layer = int(parts[2])
                if layer // half == stage:
                    own[".".join(parts[:2] + [str(layer - stage * half)] + parts[3:])] = tensor
            elif name.startswith("embedding.") == (stage == 0) or name.startswith("output_layer.") and stage == 1:
                own[name] = tensor
        path = os.path.join(folder, "release", f"mp_rank_00_{stage:03d}")
        os.makedirs(path)
        torch.save({"args": argparse.Namespace(num_layers=args.num_layers, hidden_size=args.hidden_size),
                    "checkpoint_version": 3.0, "iteration": 0, "model": own},
                   os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")


def megatron_lm_on_cpu(args):
    """Megatron-LM's globals for its checkpoint functions, and the two CUDA answers (see above)."""
    set_args(args)
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1, False)
    args.no_load_rng = args.no_load_optim = args.no_save_optim = True  # a model alone, as saved here
    torch.cuda.get_rng_state = lambda *_, **__: torch.empty(0, dtype=torch.uint8)
    on_cpu = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    on_cpu.tensor = lambda *a, device=None, **k: torch.tensor(*a, **k)
    checkpointing.torch = on_cpu
    return checkpointing


def option(flags: list[str], name: str, default: int | None) -> int | None:
    """Take a probe option out of pretrain_gpt.py's flags."""
    if name not in flags:
        return default
    at = flags.index(name)
    value = int(flags[at + 1])
    del flags[at:at + 2]
    return value


def main() -> None:
    mode, folder = sys.argv[1], sys.argv[2]
    flags = sys.argv[sys.argv.index("--") + 1:]
    index, step = option(flags, "--probe-batch", 0), option(flags, "--probe-step", None)
    args = parse_args(flags, world_size=1)
    init_distributed("gloo", 5)
    model = gpt_model(args)
    checkpointing = megatron_lm_on_cpu(args)
    if mode == "save":
        args.save = os.path.join(folder, "torch_dist")
        checkpointing.save_checkpoint(1, [model], None, None, 0)
        write_legacy(model, args, os.path.join(folder, "torch"))
    else:
        args.load, args.ckpt_step = folder, step
        iteration, _ = checkpointing.load_checkpoint([model], None, None, strict=True)
        print(f"Megatron-LM's load_checkpoint: iteration {iteration}", flush=True)
    print(f"loss {index} {batch_loss(model, args, index):.6E}", flush=True)


if __name__ == "__main__":
    main()
