"""Megatron-LM's side of the checkpoint tests: a plain GPTModel (no pipeline, one process) saved and
loaded by Megatron-LM's own ``save_checkpoint`` and ``load_checkpoint`` (megatron.training.checkpointing,
from the megatron-core wheel), as a Megatron-LM user's run does.

    python -m megatron.chimera.testing.mcore_checkpoint_probe save DIR -- FLAGS
        # DIR/torch_dist: Megatron-LM's save_checkpoint (torch_dist, iteration 1); DIR/torch: its legacy files
    python -m megatron.chimera.testing.mcore_checkpoint_probe load DIR -- FLAGS
        # Megatron-LM's load_checkpoint of DIR (a --save directory; --probe-step N picks iteration N)
    python -m megatron.chimera.testing.mcore_checkpoint_probe step DIR -- FLAGS
        # the same with its optimizer and LR scheduler, then one training step on batch BATCH

Each prints ``loss BATCH VALUE``: the LM loss of training batch BATCH (``--probe-batch``, default 0)
as pretrain_gpt.py's data gives it, with the saved or loaded weights. FLAGS are pretrain_gpt.py's. ``step``
builds Megatron-LM's optimizer (megatron-core's get_megatron_optimizer, under Megatron-LM's config of FLAGS) and
scheduler, loads them with the model, trains on batch BATCH as Megatron-LM's train_step does (each micro-batch's
loss averaged over its tokens and the micro-batches, megatron-core's optimizer step, the scheduler advanced by
the global batch), and prints ``loss BATCH+1 VALUE``: the loss the checkpointed run logs one iteration after
BATCH's, only if the loaded moments, step count, learning rate and weight decay are that run's.

Megatron-LM's checkpoint and optimizer functions run on the CPU with what only CUDA gives them replaced: the
CUDA RNG state its save stores (empty: there is no CUDA generator; loading skips RNG states, --no-load-rng)
and the ``device='cuda'`` tensors its load (the iteration number it all-reduces), its FP32Optimizer (a loss
scale of 1) and its gradient norm (megatron-core's fallback L2 norm) make (made on the CPU). Its gradient
clipping accepts CUDA gradients only: ``step`` needs --clip-grad 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import torch
from megatron.core import parallel_state
from megatron.core import utils as megatron_utils
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.optimizer import clip_grads, get_megatron_optimizer
from megatron.core.optimizer import optimizer as megatron_optimizers
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.training import checkpointing
from megatron.training.global_vars import set_args
from megatron.training.training import get_megatron_optimizer_config, get_optimizer_param_scheduler

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


def microbatches(args, index: int):
    """The micro-batches of training batch ``index``, as pretrain_gpt.py's data gives them."""
    job = job_config(args)
    data, plan = job.data, make_run_plan(job.pipeline, job.parallel)
    train, _ = build_datasets(data, build_tokenizer(data.tokenizer, args), *dataset_sizes(data))
    source = MicrobatchSource(train, data, plan, dp_rank=0, pinned=False, exit_signal=None)
    steps = source.global_batch(index)
    return [source.microbatch(steps, mb) for mb in range(plan.microbatches)]


def _token_losses(model, b) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's summed token loss and its token count."""
    losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return (losses.double() * b["loss_mask"]).sum(), b["loss_mask"].sum()


@torch.no_grad()
def batch_loss(model, args, index: int) -> float:
    total = count = 0.0
    model.eval()
    for b in microbatches(args, index):
        loss, tokens = _token_losses(model, b)
        total, count = total + float(loss), count + float(tokens)
    return total / count


def megatron_lm_optimizer(model, args):
    """Megatron-LM's optimizer and LR scheduler for ``model``, as its setup_model_and_optimizer builds them: of
    the DDP wrapper get_megatron_optimizer reads only its config, given to the model itself."""
    model.ddp_config = DistributedDataParallelConfig()
    config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(config, [model], overrides)
    return optimizer, get_optimizer_param_scheduler(optimizer)


def train_step(model, optimizer, scheduler, args, index: int) -> None:
    """One training step on batch ``index``, as Megatron-LM's train_step on one process (see the docstring)."""
    model.train()
    optimizer.zero_grad()
    batches = microbatches(args, index)
    for b in batches:
        loss, tokens = _token_losses(model, b)
        (loss.float() / tokens / len(batches)).backward()
    succeeded, _, _ = optimizer.step()
    assert succeeded, "megatron-core's optimizer skipped the step"
    scheduler.step(increment=args.global_batch_size)


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


def megatron_lm_on_cpu(args, optimizer: bool = False):
    """Megatron-LM's globals for its checkpoint functions, and the CUDA answers (see above); its optimizer state
    is loaded with ``optimizer`` only."""
    set_args(args)
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1, False)
    args.no_load_rng = args.no_save_optim = True  # a model alone, as saved here
    args.no_load_optim = not optimizer
    torch.cuda.get_rng_state = lambda *_, **__: torch.empty(0, dtype=torch.uint8)
    on_cpu = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    on_cpu.tensor = lambda *a, device=None, **k: torch.tensor(*a, **k)
    on_cpu.zeros = lambda *a, device=None, **k: torch.zeros(*a, **k)
    checkpointing.torch = megatron_optimizers.torch = clip_grads.torch = megatron_utils.torch = on_cpu
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
    checkpointing = megatron_lm_on_cpu(args, optimizer=mode == "step")
    if mode == "save":
        args.save = os.path.join(folder, "torch_dist")
        checkpointing.save_checkpoint(1, [model], None, None, 0)
        write_legacy(model, args, os.path.join(folder, "torch"))
    else:
        optimizer, scheduler = megatron_lm_optimizer(model, args) if mode == "step" else (None, None)
        args.load, args.ckpt_step = folder, step
        iteration, _ = checkpointing.load_checkpoint([model], optimizer, scheduler, strict=True)
        print(f"Megatron-LM's load_checkpoint: iteration {iteration}", flush=True)
        if mode == "step":
            train_step(model, optimizer, scheduler, args, index)
            index += 1
    print(f"loss {index} {batch_loss(model, args, index):.6E}", flush=True)


if __name__ == "__main__":
    main()
