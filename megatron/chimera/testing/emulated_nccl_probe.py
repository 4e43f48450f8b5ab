"""Does a design of the communication complete under the emulated NCCL transport?

    torchrun --nproc_per_node 2 -m megatron.chimera.testing.emulated_nccl_probe --design lowered|legacy

Trains one 1F1B D=2 iteration with ``--emulate-nccl`` and a 6-second timeout, either with the
lowering the trainer uses or with the former executor's communication (legacy_lowering.py: one group
per pipeline, receives at need). Rank 0 prints one JSON line: {"design", "completed", "error"}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from chimera_schedules.runtime.executor import make_forward_backward
from chimera_schedules.runtime.faults import PipelineFault
from megatron.chimera import Trainer, job_config, make_run_plan, parse_args
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.testing.legacy_lowering import legacy_lower

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "128", "--mock-data", "--lr", "1e-3",
         "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", "--emulate-nccl",
         "--distributed-timeout-minutes", "0.1"]


def main() -> None:
    design = argparse.ArgumentParser()
    design.add_argument("--design", choices=("lowered", "legacy"), required=True)
    which = design.parse_args().design
    args = parse_args(FLAGS)
    job = job_config(args)
    trainer = Trainer(job, make_run_plan(job.pipeline, job.parallel), forward_step)
    if which == "legacy":  # one process group per pipeline, as parallel.py made them then
        groups = {**trainer.transport.groups, "p0": trainer.transport.groups["down"]}
        transport = dataclasses.replace(trainer.transport, groups=groups)
        legacy = make_forward_backward(legacy_lower(trainer.plan.schedule), transport, trainer.sync)
        trainer.runs[job.data.global_batch_size] = (legacy, trainer.orders)  # the plan every iteration runs
    try:
        trainer.train_step(0)
        result = {"design": which, "completed": True, "error": None}
    except PipelineFault as e:
        result = {"design": which, "completed": False, "error": str(e)}
    if trainer.rt.rank == 0:
        print(json.dumps(result), flush=True)
    os._exit(0)  # a hung design leaves emulated streams blocked: no clean-up collective


if __name__ == "__main__":
    main()
