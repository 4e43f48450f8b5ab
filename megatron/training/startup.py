"""Megatron-LM's startup output, so a user's log parsers find it: the arguments banner, "building GPT
model ...", and the parameter count of every model chunk (for Chimera, one line per stage copy)."""
from __future__ import annotations

import os

import torch.distributed as dist

_HIDDEN = ("schedule", "plan")  # derived objects, not settings


def print_banner(args) -> None:
    """The arguments, one per line with dotted padding, from global rank 0 only (before any group)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(vars(args)):
        if name not in _HIDDEN:
            lines.append(f"  {name} {'.' * (48 - len(name))} {getattr(args, name)}")
    lines.append("-------------------- end of arguments ---------------------")
    print("\n".join(lines), flush=True)


def print_building() -> None:
    if dist.get_rank() == 0:
        print("building GPT model ...", flush=True)


def print_parameter_counts(chunks: dict, rt) -> None:
    """As Megatron-LM, from data-parallel rank 0: one line per chunk, the worker as the pipeline rank."""
    if rt.dp_rank != 0:
        return
    for (pipeline, stage), chunk in chunks.items():
        count = sum(p.numel() for p in chunk.parameters())
        copy = f" (pipeline {pipeline}, stage {stage})" if len(rt.placement) > 1 or len(chunks) > 1 else ""
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({rt.tp_rank}, {rt.worker}): "
              f"{count}{copy}", flush=True)
