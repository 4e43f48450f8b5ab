"""``python -m megatron.chimera.profile``: the stage costs ``--pipeline-schedule auto`` measures at startup,
written to a file that ``--pipeline-profile FILE`` reads back, so that a run (or ``python -m
megatron.chimera.plan``, offline) plans from them without measuring again.

It reads the model from a Megatron-LM command line as a launch script has it (a file of flags, the command
line after ``--``, or both; the parallel and batch flags are read for the expert-parallel share only) and
times its parts on this machine's device (stage_costs.py). Under torchrun every rank measures and the file
holds the median of the ranks, as at a run's startup:

    torchrun --nproc-per-node 8 -m megatron.chimera.profile --out my_model.costs.json \\
        --flags-file my_model.flags
    python -m chimera_schedules profile my_model.costs.json   # what it holds
"""
from __future__ import annotations

import argparse

import torch.distributed as dist

from chimera_schedules import ConfigError
from chimera_schedules.ir.spec import flags

from .arguments import one_process
from .config.auto_plan import base_argv
from .config.parser import fail
from .distributed.process_groups import made_here
from .plan import flags_of
from .stage_costs import measure

PROG = "python -m megatron.chimera.profile"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the stage-cost profile to write (JSON)")
    parser.add_argument("--flags-file", help="a file of Megatron-LM flags (a launch script's, without the program)")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], metavar="B",
                        help="the sizes to measure at (default 1 2 4 8: those --pipeline-schedule auto may pick)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- and more Megatron-LM flags (they come last)")
    options = parser.parse_args(argv)
    given = base_argv((flags_of(options.flags_file) if options.flags_file else [])
                      + [f for i, f in enumerate(options.flags) if not (i == 0 and f == "--")])
    try:
        measured = measure(given, one_process(given), one_process, sorted(set(options.micro_batch_sizes)))
    except ConfigError as e:
        fail(f"{PROG}: error: {e.message(flags('trainer'))}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        measured.save(options.out)
        for b in sorted(measured.times):
            print(f" > stage parts (ms forward/backward, micro-batch size {b}, one device): {measured.describe(b)}")
        print(f" > wrote {options.out} (measured on {measured.source}): give it as --pipeline-profile", flush=True)
    if made_here():
        dist.destroy_process_group()
    return options.out


if __name__ == "__main__":
    main()
