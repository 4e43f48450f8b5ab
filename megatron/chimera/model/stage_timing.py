"""One micro-batch's forward and backward through a one-process model chunk, timed: what the startup
measurement of stage costs (megatron/chimera/stage_costs.py) runs on each small model it builds.

The chunk is the trainer's own (``build_chunk``: megatron-core's GPTModel with the run's layer spec,
precision and Transformer Engine where it would be used) and is called as the forward step calls it, so
a part costs here what it costs in training. The random state and megatron-core's loss scales are the
caller's again afterwards: a plan measured at startup must leave the run it picks unchanged.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from .chunk import build_chunk

WARM_UPS = 2  # the first passes allocate and pick kernels
# megatron-core's process-wide loss scales, which a first backward creates and the trainer's first step sets
SCALERS = (MoEAuxLossAutoScaler, MTPLossAutoScaler)
DEPRECATION = "megatron.core.models.gpt.gpt_model"  # says GPTModel is deprecated at each build: the trainer's says it


@contextlib.contextmanager
def _quiet(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def pass_times(spec, plan, device: torch.device, sizes: list[int], seq: int, vocab: int,
               repeats: int) -> dict[int, tuple[float, float]]:
    """{micro-batch size: (forward s, backward s)} of stage 0 of ``plan`` (one stage holding the whole small
    model), the fastest of ``repeats`` passes after the warm-ups, at each size: the least disturbed one, on a
    machine whose other ranks (or tenants) share the cores."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _quiet(DEPRECATION), _scales_kept():
        model_parallel_cuda_manual_seed(spec.seed)  # as the Trainer does before it builds
        chunk = build_chunk(spec, plan, 0, device)
        out = {b: _fastest_pass(chunk, b, seq, vocab, device, repeats) for b in sizes}
    del chunk
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


@contextlib.contextmanager
def _scales_kept():
    held = [scaler.main_loss_backward_scale for scaler in SCALERS]
    try:
        yield
    finally:
        for scaler, scale in zip(SCALERS, held):
            scaler.main_loss_backward_scale = scale


def _fastest_pass(chunk, b: int, seq: int, vocab: int, device: torch.device, repeats: int) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(b)
    tokens = torch.randint(vocab, (b, seq), generator=generator).to(device)
    positions = torch.arange(seq, device=device).expand(b, seq)
    mask = torch.ones(b, seq, device=device)
    forward, backward = [], []
    for i in range(WARM_UPS + repeats):
        start = _now(device)
        loss = chunk(tokens, positions, None, labels=tokens, loss_mask=mask).float().sum()
        middle = _now(device)
        loss.backward()
        end = _now(device)
        if i >= WARM_UPS:
            forward.append(middle - start)
            backward.append(end - middle)
    chunk.zero_grad(set_to_none=True)
    return min(forward), min(backward)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
