"""``python -m megatron.chimera.plan``: the plan ``--pipeline-schedule auto`` would pick, without a cluster.

It reads a Megatron-LM command line as a launch script has it (a file of flags, the command line after
``--``, or both), adds ``--pipeline-schedule auto`` unless given, and prints the startup table and the
`` > pipeline plan:`` line a run on ``--world-size`` processes would print, from the same code
(config/auto_plan.py). The schedule library's own ``python -m chimera_schedules plan`` ranks shapes given
as its own flags and cannot read Megatron-LM's (it imports no megatron-core).

    python -m megatron.chimera.plan --world-size 64 --flags-file my_model.flags -- \\
        --pipeline-model-parallel-size 8 --pipeline-memory-limit-gb 70
"""
from __future__ import annotations

import argparse
import shlex

from .arguments import plan_only
from .config.auto_plan import asks_auto


def flags_of(path: str) -> list[str]:
    """A file of flags as a shell reads them: quotes, line continuations and # comments."""
    with open(path) as f:
        return shlex.split(f.read().replace("\\\n", " "), comments=True)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m megatron.chimera.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="the number of processes (GPUs) of the run")
    parser.add_argument("--flags-file", help="a file of Megatron-LM flags (a launch script's, without the program)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- and more Megatron-LM flags (they come last)")
    options = parser.parse_args(argv)
    given = (flags_of(options.flags_file) if options.flags_file else []) + \
        [f for i, f in enumerate(options.flags) if not (i == 0 and f == "--")]
    return plan_only(given if asks_auto(given) else given + ["--pipeline-schedule", "auto"], options.world_size)


if __name__ == "__main__":
    main()
