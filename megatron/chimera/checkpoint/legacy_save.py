"""--ckpt-format torch with --save: Megatron-LM's legacy per-rank files, as Megatron-LM with the same
tensor parallelism and PP = D writes them.

    SAVE/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt     (``_PPP`` when D > 1)

Megatron-LM's pipeline rank p holds model stage p. Under Chimera worker i holds stage i of the down
pipeline and stage D-1-i of the up one; the two copies of a stage are equal after every step, so worker
i writes its down copy (pipeline 0) as pipeline rank i; under 1F1B pipeline 0 is the only one. Data-
parallel rank 0 writes, as in Megatron-LM. Each file holds what Megatron-LM's ``generate_state_dict``
puts there: ``model`` (the stage's state dict, its layers numbered from 0), ``args``,
``checkpoint_version``, ``iteration``, ``rng_state``, a list of this rank's generators as Megatron-LM's
``get_rng_state`` gives it without --data-parallel-random-init, and, unless --no-save-optim (then Megatron-LM
leaves out the LR scheduler too), ``optimizer``, the stage's optimizer state as megatron-core's optimizer over
it gives it (legacy_optimizer.py), and ``opt_param_scheduler``, megatron-core's scheduler's state dict.

Not written with --use-distributed-optimizer: Megatron-LM then keeps the parameter state in a
``distrib_optim.pt`` laid out by its DDP's gradient buffers (buckets, padding), which megatron-core builds on
CUDA tensors only, so it could not be built or checked here (run_rules.py refuses it, and Muon's).
checkpointing.py publishes the folder as it does a torch_dist one (manifest, rename, ``latest``), each
file's digest taken by the rank that wrote it; legacy.py reads it.
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from .legacy_optimizer import megatron_groups, optimizer_state_dict
from .states import LegacyStates

FILE = "model_optim_rng.pt"


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's ``get_checkpoint_name`` folder of a (tensor, pipeline) rank."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _rng_state() -> dict:
    """This process's generators under Megatron-LM's names (an empty CUDA state without a CUDA generator)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if cuda else torch.empty(0, dtype=torch.uint8),
            "rng_tracker_states": get_cuda_rng_tracker().get_states()}


def save_legacy(parts: LegacyStates, rt, folder: str, common: dict, megatron_args) -> list[str]:
    """This rank's file in ``folder``, if it writes one: of the states ``parts`` keeps, the down-pipeline chunk of
    the model and, with the optimizer, its optimizer state and the LR scheduler's, with ``common`` (iteration,
    args, checkpoint_version) and the RNG states. Collective with the optimizer (megatron-core's parameter groups
    are gathered from every rank, under Megatron-LM's config of ``megatron_args``). Returns the paths it wrote
    (none or one), whose digests this rank takes for the manifest."""
    model = parts.model
    model.main.flush()  # pending parameter gathers (--overlap-param-gather) land in the weights first
    down = [chunk for chunk, pipeline, _ in model.placed if pipeline == 0]
    assert len(down) == 1, f"worker {rt.worker} holds {len(down)} down-pipeline stages; the torch format needs 1"
    saved = {**common, "model": down[0].state_dict()}
    if parts.rng:
        saved["rng_state"] = [_rng_state()]
    if parts.optimizer is not None:
        saved.update(_optimizer(parts, down[0], megatron_args))
    if rt.dp_rank != 0 or rt.cp_rank != 0:  # the copies at other DP and CP ranks are the same
        return []
    path = os.path.join(folder, rank_dir(rt.tp_rank, rt.worker, rt.pp))
    os.makedirs(path, exist_ok=True)
    torch.save(saved, os.path.join(path, FILE))
    return [os.path.join(path, FILE)]


def _optimizer(parts: LegacyStates, chunk, megatron_args) -> dict:
    """Megatron-LM's ``optimizer`` and ``opt_param_scheduler`` of ``chunk``, from the trainer's optimizer, loss
    scale (--fp16) and scheduler. Collective."""
    whole, step = parts.optimizer.whole_state()
    config, (groups,) = megatron_groups([chunk], megatron_args)
    return {"optimizer": optimizer_state_dict(groups, config, whole, step, parts.scheduler, parts.scaler,
                                              parts.optimizer.main.half),
            "opt_param_scheduler": parts.scheduler.state_dict()}
