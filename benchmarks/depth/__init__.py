"""The depth benchmark (``python -m benchmarks.depth``): schedules at real pipeline depths on an
emulated device; ``__main__`` launches the ranks, the modules beside it hold the stages, runtimes, layouts,
costs and report."""
