"""The run plan of a parsed command line, made as ``pretrain`` makes it: from the job's pipeline and parallel
sections (config/job.py), never from the namespace itself. For the tests that ask a plan of flags."""
from __future__ import annotations

import argparse

from megatron.chimera.config.job import job_config
from megatron.chimera.config.run_plan import RunPlan, make_run_plan


def plan_of(args: argparse.Namespace) -> RunPlan:
    job = job_config(args)
    return make_run_plan(job.pipeline, job.parallel)
