"""Benchmarks that compare schedules and runtimes side by side, each run as ``python -m benchmarks.<name>``
from the repository root: quick, depth, memory, communicators, activation_memory, scale_projection and
moe_scale_projection. Each writes JSON, tables and a plot to ``benchmarks/results/``."""
