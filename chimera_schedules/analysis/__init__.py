"""Analyses read a schedule and change nothing: the replay, the validator (compute lists), the NCCL
checker (lowered lists), the simulator (the one place that tells the two apart) and measured
timelines. They import only the IR."""
